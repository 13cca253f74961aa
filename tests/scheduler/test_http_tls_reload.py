"""The HTTP front's TLS (scheduler/http/serve.py + tandem/security/tls.py) on a real uvicorn server in this
process: after the certificate files are replaced (and SIGHUP's reload_now), a new connection gets the new
certificate and the new client CA, while a response streaming on a connection opened before goes on; mTLS
refuses a client without a certificate or with one of another CA."""
from __future__ import annotations

import asyncio
import shutil
import ssl
import threading

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from scheduler.http.serve import HttpFront
from tandem.security.tls import ReloadingTls, server_paths
from tests.security_fixtures import make_pki


def _client_context(trust, client) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(trust.ca))
    if client is not None:
        ctx.load_cert_chain(*map(str, client.client()))
    return ctx


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(front url, pki, files dir, tls source, release) with uvicorn on a loop of its own thread; GET /stream
    sends "first", then "second" once release is set."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    files = tmp_path_factory.mktemp("served")
    cert, key = pki.server()
    for src, name in ((cert, "server.pem"), (key, "server.key"), (pki.ca, "client-ca.pem")):
        shutil.copy(src, files / name)
    tls = ReloadingTls(server_paths(files / "server.pem", files / "server.key", files / "client-ca.pem"))
    app = FastAPI()
    app.get("/ping")(lambda: {"pong": True})
    release = threading.Event()

    async def chunks():
        yield "first"
        await asyncio.to_thread(release.wait, 60)
        yield "second"

    app.get("/stream")(lambda: StreamingResponse(chunks()))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    def begin():
        try:
            holder["front"] = HttpFront(app, "127.0.0.1", 0, tls)
            holder["front"].start()  # serves on this loop, the socket already listening
        finally:
            started.set()

    def run():
        asyncio.set_event_loop(loop)
        loop.call_soon(begin)
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30) and "front" in holder
    yield holder["front"].url, pki, files, tls, release
    release.set()
    asyncio.run_coroutine_threadsafe(holder["front"].stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_https_with_mtls(served):
    url, pki, *_ = served
    assert url.startswith("https://127.0.0.1:")
    with httpx.Client(verify=_client_context(pki, pki)) as client:
        assert client.get(f"{url}/ping").json() == {"pong": True}
    with pytest.raises(httpx.HTTPError), httpx.Client(verify=_client_context(pki, None)) as client:
        client.get(f"{url}/ping")  # no client certificate: refused in the handshake
    with pytest.raises(httpx.HTTPError), httpx.Client(verify=_client_context(pki, pki.other)) as client:
        client.get(f"{url}/ping")  # a client certificate of another CA


def test_rotated_files_reach_new_connections_while_a_stream_goes_on(served):
    url, pki, files, tls, release = served
    with httpx.Client(verify=_client_context(pki, pki), timeout=60) as before, \
            before.stream("GET", f"{url}/stream") as streaming:
        chunks = streaming.iter_text()
        assert next(chunks) == "first"  # a response under way on a connection made with the old certificate
        cert, key = pki.other.server()
        for src, name in ((cert, "server.pem"), (key, "server.key"), (pki.other.ca, "client-ca.pem")):
            shutil.copy(src, files / name)
        tls.reload_now()  # what SIGHUP does
        with httpx.Client(verify=_client_context(pki.other, pki.other)) as after:
            assert after.get(f"{url}/ping").status_code == 200  # the new certificate and the new client CA
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=_client_context(pki, pki)) as old_trust:
            old_trust.get(f"{url}/ping")
        release.set()
        assert "".join(chunks) == "second"  # the stream opened before the rotation ends normally
