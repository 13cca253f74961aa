"""The executor behind TLS, mTLS and tokens, as a real process: certificates made at test time (a CA, a
server and a client certificate, and a second CA whose certificates it must refuse). Plaintext is refused;
TLS needs the right CA; mTLS refuses a missing or wrongly signed client certificate; a missing or unknown
token is UNAUTHENTICATED and a user token on an admin RPC PERMISSION_DENIED; health stays open; reflection
needs a token (grpcurl -H); a rewritten token file takes effect without a restart; and a rotated certificate
is served to new connections while a stream opened before it goes on. The --metrics-port follows the same
TLS files, client CA and tokens (an admin token, as the scheduler's /metrics). Nothing logs a token."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.executor.test_grpcurl import GRPCURL
from tests.grpc_harness import start_for
from tests.kv_event_reader import KvEventReader, stored
from tests.security_fixtures import Pki, bearer, make_pki, new_token, write_tokens

ADMIN, USER, LATER = new_token(), new_token(), new_token()
DENIED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, pki):
    """The executor's own copies of its certificate, key and token file (tests rewrite them)."""
    d = tmp_path_factory.mktemp("served")
    cert, key = pki.server()
    shutil.copy(cert, d / "server.pem")
    shutil.copy(key, d / "server.key")
    write_tokens(d / "tokens", {ADMIN: "admin", USER: "user"})
    return d


@pytest.fixture(scope="module")
def executor(request, model_dir, pki, files, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return start_for(request, model_dir, "--kv-blocks", "64", "--adapter-root", str(root),
                     "--tls-cert", str(files / "server.pem"), "--tls-key", str(files / "server.key"),
                     "--tls-client-ca", str(pki.ca), "--auth-token-file", str(files / "tokens"),
                     "--metrics-port", "0", credentials=pki.credentials(client=pki))


def fresh_stub(executor, credentials: grpc.ChannelCredentials | None) -> tuple[grpc.Channel, pb_grpc.ExecutorServiceStub]:
    """A stub on a new connection of its own (no subchannel shared with other channels: a new handshake)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.insecure_channel(executor.address, options) if credentials is None \
        else grpc.secure_channel(executor.address, credentials, options)
    return channel, pb_grpc.ExecutorServiceStub(channel)


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_startup_log_states_the_posture(executor):
    assert "security: TLS on (mTLS), tokens on (2 tokens, 1 admin), reflection on, health open" in executor.stderr()


@pytest.mark.parametrize("who", ["plaintext", "untrusted server CA", "no client certificate",
                                 "client certificate of another CA"])
def test_connections_without_the_right_certificates_fail(executor, pki, who):
    credentials = {"plaintext": None, "untrusted server CA": pki.credentials(trust=pki.other, client=pki),
                   "no client certificate": pki.credentials(),
                   "client certificate of another CA": pki.credentials(client=pki.other)}[who]
    channel, stub = fresh_stub(executor, credentials)
    with channel:
        assert code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(ADMIN), timeout=10)) \
            == grpc.StatusCode.UNAVAILABLE


def test_the_right_certificates_and_a_token_work(executor, pki):
    channel, stub = fresh_stub(executor, pki.credentials(client=pki))
    with channel:
        assert stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(USER), timeout=10).vocab_size > 0


def test_missing_or_unknown_token_is_unauthenticated(executor):
    for metadata in (None, bearer(new_token()), (("authorization", USER),)):  # the last: no "Bearer " scheme
        with pytest.raises(grpc.RpcError) as err:
            executor.stub.GetInfo(pb.GetInfoRequest(), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in err.value.details() or "not valid" in err.value.details()
        assert USER not in err.value.details()


ADMIN_CALLS = {  # rpc -> (call, what an admin token gets: the RPC's own answer once past the check)
    "LoadAdapter": (lambda stub, md: stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path="missing"), metadata=md,
                                                      timeout=10), grpc.StatusCode.INVALID_ARGUMENT),
    "UnloadAdapter": (lambda stub, md: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"), metadata=md, timeout=10),
                      grpc.StatusCode.NOT_FOUND),
    "ListCaches of every session": (lambda stub, md: stub.ListCaches(pb.ListCachesRequest(), metadata=md, timeout=10),
                                    grpc.StatusCode.OK),
    "SubscribeKvEvents": (lambda stub, md: next(stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(), metadata=md,
                                                                       timeout=10)), grpc.StatusCode.OK),
    "ImportKv": (lambda stub, md: stub.ImportKv(pb.ImportKvRequest(), metadata=md, timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("rpc", list(ADMIN_CALLS))
def test_admin_rpcs_need_an_admin_token(executor, rpc):
    call, admin_gets = ADMIN_CALLS[rpc]
    assert code_of(lambda: call(executor.stub, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: call(executor.stub, bearer(new_token()))) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        call(executor.stub, bearer(USER))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == f"{rpc.split()[0]} needs a token with scope admin; this token has scope user"
    # An admin token passes the check: what follows is the RPC's own answer (no adapter "a" here).
    assert code_of(lambda: call(executor.stub, bearer(ADMIN))) == admin_gets


def test_user_token_works_within_its_own_session(executor):
    md = bearer(USER)
    sid = executor.stub.OpenSession(pb.OpenSessionRequest(client_name="user"), metadata=md, timeout=10).session_id
    res = executor.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7, 8], session_id=sid), metadata=md, timeout=30)
    (listed,) = executor.stub.ListCaches(pb.ListCachesRequest(session_id=sid), metadata=md, timeout=10).sessions
    assert [c.cache_id for c in listed.caches] == [res.cache.cache_id]
    executor.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=md, timeout=10)


def test_health_stays_open_for_probes(executor):
    health = health_pb2_grpc.HealthStub(executor.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary: install the test extra")
def test_grpcurl_with_ca_client_certificate_and_token(executor, pki):
    cert, key = pki.client()
    base = [GRPCURL, "-cacert", str(pki.ca), "-cert", str(cert), "-key", str(key)]
    refused = subprocess.run([*base, executor.address, "list"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr  # reflection needs a token too
    listed = subprocess.run([*base, "-H", f"authorization: Bearer {USER}", executor.address, "list"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "tandem.executor.v1.ExecutorService" in listed.stdout, listed.stderr
    denied = subprocess.run([*base, "-H", f"authorization: Bearer {USER}", "-d", "{}", executor.address,
                             "tandem.executor.v1.ExecutorService/ListCaches"], capture_output=True, text=True, timeout=60)
    assert denied.returncode != 0 and "PermissionDenied" in denied.stderr
    admin = subprocess.run([*base, "-H", f"authorization: Bearer {ADMIN}", "-d", "{}", executor.address,
                            "tandem.executor.v1.ExecutorService/ListCaches"], capture_output=True, text=True, timeout=60)
    assert admin.returncode == 0 and "kv" in json.loads(admin.stdout), admin.stderr


def _until(check, timeout_s: float = 15.0, what: str = "the change"):
    """Polls check() (files are looked at once per second at most) until it returns a true value."""
    end = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not take effect within {timeout_s:.0f}s")
        time.sleep(0.1)  # poll interval, not synchronisation: the server re-reads files at most once per second


def test_token_file_is_reread_when_it_changes(executor, files):
    path = files / "tokens"
    stub = executor.stub
    assert code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(LATER), timeout=10)) \
        == grpc.StatusCode.UNAUTHENTICATED
    try:
        write_tokens(path, {ADMIN: "admin", LATER: "user"})  # USER revoked, LATER added
        _until(lambda: code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(LATER), timeout=10))
               == grpc.StatusCode.OK, what="the new token")
        assert code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(USER), timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED
        path.write_text("not-a-valid-line because of the extra words\n")  # a broken file: the old tokens stay
        executor.process.send_signal(signal.SIGHUP)  # and SIGHUP reads it at once
        # Read at the next call: it is refused (logged) and that call, like later ones, still gets through.
        _until(lambda: code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(LATER), timeout=10))
               == grpc.StatusCode.OK and "tokens read before stay in force" in executor.stderr(), what="the refusal")
    finally:
        write_tokens(path, {ADMIN: "admin", USER: "user"})
        _until(lambda: code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(USER), timeout=10))
               == grpc.StatusCode.OK, what="the restored file")


def metrics_url(server) -> str:
    found = re.search(r"metrics on (https://\S+/metrics) \(needs a client certificate and an admin token\)",
                      server.stderr())
    assert found, "no metrics line in the log"
    return found.group(1)


def https_client(trust: Pki, client: Pki | None) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(trust.ca))
    if client is not None:
        context.load_cert_chain(*(str(p) for p in client.client()))
    return httpx.Client(verify=context, timeout=10)


def test_metrics_port_needs_tls_a_client_certificate_and_an_admin_token(executor, pki):
    url = metrics_url(executor)
    with pytest.raises(httpx.HTTPError):  # plaintext: the server expects a TLS handshake and closes
        httpx.get(url.replace("https://", "http://"), timeout=10)
    with https_client(pki, None) as no_cert, pytest.raises(httpx.HTTPError):  # mTLS: refused in the handshake
        no_cert.get(url, headers={"authorization": f"Bearer {ADMIN}"})
    with https_client(pki, pki) as http:
        missing = http.get(url)
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
        assert "needs a token" in missing.text and ADMIN not in missing.text
        assert http.get(url, headers={"authorization": f"Bearer {LATER}"}).status_code == 401  # unknown token
        user = http.get(url, headers={"authorization": f"Bearer {USER}"})
        assert user.status_code == 403 and "scope admin" in user.text
        admin = http.get(url, headers={"authorization": f"Bearer {ADMIN}"})
        assert admin.status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(admin.text)}
        assert families["tandem:executor_kv_total_blocks"].samples[0].value == 64
    # The server still answers model calls after the refused connections (none held a thread for long).
    assert executor.stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(USER), timeout=10).model_id


def test_rotated_certificate_reaches_new_connections_while_a_stream_goes_on(executor, pki, files):
    """Last in the module: the executor serves the other CA's certificate afterwards."""
    events = KvEventReader(executor.stub, summary_interval_ms=60_000, metadata=bearer(ADMIN))
    try:
        events.next()  # subscribed on the connection opened before the rotation
        cert, key = pki.other.server()
        for src, name in ((cert, "server.pem"), (key, "server.key")):  # atomic replace, as a Secret update does
            shutil.copy(src, files / f"{name}.new")
            os.replace(files / f"{name}.new", files / name)

        def new_certificate_served():
            channel, stub = fresh_stub(executor, pki.credentials(trust=pki.other, client=pki))
            with channel:
                return code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(USER), timeout=5)) \
                    == grpc.StatusCode.OK

        _until(new_certificate_served, what="the rotated certificate")
        channel, stub = fresh_stub(executor, pki.credentials(client=pki))  # trusts only the old CA
        with channel:
            assert code_of(lambda: stub.GetInfo(pb.GetInfoRequest(), metadata=bearer(USER), timeout=5)) \
                == grpc.StatusCode.UNAVAILABLE
        # The connection opened before still serves: new calls on it, and the stream's next events.
        prompt = list(range(3, 3 + 40))  # two full blocks of 16: two hashes stored
        res = executor.stub.Prefill(pb.PrefillRequest(token_ids=prompt), metadata=bearer(USER), timeout=30)
        got = stored(events.until(lambda m: bool(stored([m])), what="the stored blocks"))
        assert sum(len(s.block_hashes) for s in got) == 2
        executor.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[res.cache.cache_id]), metadata=bearer(USER),
                                   timeout=10)
        assert "certificates re-read (--tls-cert)" in executor.stderr()

        def metrics_on_new_certificate():  # the metrics port follows the same files
            with https_client(pki.other, pki) as http:
                try:
                    return http.get(metrics_url(executor), headers={"authorization": f"Bearer {ADMIN}"}).status_code \
                        == 200
                except httpx.HTTPError:
                    return False
        _until(metrics_on_new_certificate, what="the rotated certificate on the metrics port")
    finally:
        events.close()


def test_no_token_in_the_log(executor):
    log = executor.stderr()
    assert "security: TLS on" in log
    for token in (ADMIN, USER, LATER):
        assert token not in log
