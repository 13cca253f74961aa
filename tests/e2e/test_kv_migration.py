"""KV that moves between executors, with real processes (tiny llama): live migration off an executor told to stop
(SIGTERM) while another serves — every stream continues with exactly the tokens of an undisturbed run (greedy and
seeded), requests_migrated_total grows, no token is recomputed and the drained executor exits within seconds;
SIGKILL of the source right as it drains loses no stream (recompute where the move failed); prefill + decode
executors give the tokens of a single `both` executor, the prompt on one and the decode on the other; a transfer
that fails (the prefill executor refuses the decode one's peer link) is recomputed on the decode executor and
counted, and a prefill executor killed under its hand-offs loses no stream; a tensor-parallel decode executor
(another KV layout) is never a hand-off target — a compatible one is, and with none the request decodes where its
prompt ran — so no transfer fails and nothing is recomputed; a scheduler SIGKILLed while transfers
run leaks no KV block on either executor (session leases); an executor drained with no other one serving finishes
its streams, then exits."""
from __future__ import annotations

import concurrent.futures as cf
import re
import socket
import time
import urllib.request

import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_executor, start_for, start_scheduler, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free
from tests.security_fixtures import new_token, write_tokens

KV = ("--kv-blocks", "160", "--session-ttl", "3")
_URL = re.compile(r"metrics on (https?://\S+/metrics)")
_SAMPLE = re.compile(r"^(tandem:[a-z_]+) ([0-9.e+-]+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counters(scheduler) -> dict[str, float]:
    url = _URL.search(scheduler.stderr()).group(1)
    with urllib.request.urlopen(url, timeout=10) as resp:
        return {m.group(1): float(m.group(2)) for m in _SAMPLE.finditer(resp.read().decode())}


def _sampled(executor) -> int:
    return executor.stub.GetMetrics(epb.GetMetricsRequest()).tokens_sampled


def _requests(n: int, new_tokens: int, base: int = 40) -> list[pb.GenerateRequest]:
    """Half greedy, half seeded sampling; prompts of 20-60 tokens (several KV blocks each)."""
    stop = pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True)
    out = []
    for i in range(n):
        prompt = [1] + [(base + 7 * i + 13 * k) % 380 + 3 for k in range(20 + 5 * i)]
        sampling = cpb.SamplingParams(temperature=0.9, top_k=40, seed=1000 + i) if i % 2 else None
        out.append(ids_request(prompt, 0, stopping=stop, sampling=sampling))
    return out


def _rest(call, first) -> list[int]:
    return list(first.token_ids) + [t for m in call for t in m.token_ids]


@pytest.fixture(scope="module")
def reference(request, pair):
    """One `both` executor alone (A, at its fixed address): the tokens every arrangement must give. (Its run
    leaves the prompts cached on A: the pair's scheduler then routes them there, the executor to drain.)"""
    return start_scheduler_for(request, f"127.0.0.1:{pair.port}")


def _clean(reference, reqs) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        return [r.token_ids for r in pool.map(lambda r: collect(reference.stub, r), reqs)]


class Pair:
    """Executors A (fixed port: drained or killed, then restarted) and B, and a scheduler over both."""

    def __init__(self, request, model) -> None:
        self.model, self.port = model, _free_port()
        self.a = start_executor(model, "--port", str(self.port), *KV)
        request.addfinalizer(lambda: self.a.close() if self.a.proc.poll() is None else None)  # (not once killed)
        self.b = start_for(request, model, *KV)
        self.scheduler = start_scheduler_for(request, self.a.address, "--executor", self.b.address,
                                             "--metrics-port", "0")

    def restart_a(self) -> None:
        if self.a.proc.poll() is None:
            self.a.close()
        self.a = start_executor(self.model, "--port", str(self.port), *KV)
        deadline = time.monotonic() + 30
        while any(e.state != pb.ExecutorStatus.STATE_SERVING
                  for e in self.scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).executors):
            assert time.monotonic() < deadline, "the restarted executor did not rejoin"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def pair(request, model_dir) -> Pair:
    return Pair(request, model_dir)


@pytest.fixture(scope="module")
def roles(request, model_dir):
    prefill = start_for(request, model_dir, "--role", "prefill", *KV)
    decode = start_for(request, model_dir, "--role", "decode", *KV)
    return prefill, decode


def test_prefill_and_decode_executors_give_a_single_executors_tokens(request, roles, reference):
    prefill, decode = roles
    scheduler = start_scheduler_for(request, prefill.address, "--executor", decode.address, "--metrics-port", "0")
    reqs = _requests(8, 40, base=150)
    clean = _clean(reference, reqs)
    before = (_sampled(prefill), _sampled(decode), _counters(scheduler))
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        got = list(pool.map(lambda r: collect(scheduler.stub, r), reqs))
    assert [g.token_ids for g in got] == clean
    after = _counters(scheduler)
    assert _sampled(prefill) - before[0] == len(reqs)  # one token per request: the prompt's
    assert _sampled(decode) - before[1] == len(reqs) * 39  # every other token
    assert after["tandem:requests_migrated_total"] - before[2]["tandem:requests_migrated_total"] == len(reqs)
    assert after["tandem:tokens_recomputed_total"] == before[2]["tandem:tokens_recomputed_total"]
    wait_kv_free(prefill.stub)  # the prefill executor's caches were released once moved
    wait_kv_free(decode.stub)


def test_a_prefill_executor_killed_under_its_hand_offs_loses_no_stream(request, roles, reference):
    _, decode = roles
    prefill = start_executor(request.getfixturevalue("model_dir"), "--role", "prefill", *KV)
    try:
        scheduler = start_scheduler_for(request, prefill.address, "--executor", decode.address, "--metrics-port", "0")
        reqs = _requests(12, 24, base=300)
        clean = _clean(reference, reqs)
        calls = [scheduler.stub.Generate(r, timeout=120) for r in reqs]
        first = next(calls[0])
        prefill.process.kill()  # prompts still queued there, hand-offs under way: recomputed on the decode one
        got = [_rest(calls[0], first)] + [[t for m in c for t in m.token_ids] for c in calls[1:]]
        assert got == clean  # every stream ends (no error), with a single executor's tokens
        wait_kv_free(decode.stub)
    finally:
        prefill.process.kill()
        prefill.channel.close()


def test_a_transfer_that_fails_is_recomputed_on_the_decode_executor(request, model_dir, tmp_path, roles, reference):
    _, decode = roles
    token = new_token()  # the prefill executor wants a token, which the decode executor's peer link lacks
    prefill = start_for(request, model_dir, "--role", "prefill", *KV, "--auth-token-file",
                        str(write_tokens(tmp_path / "executor.tokens", {token: "admin"})))
    scheduler = start_scheduler_for(request, prefill.address, "--executor", decode.address, "--metrics-port", "0",
                                    "--executor-token-file", str(write_tokens(tmp_path / "at.token", {token: "admin"})))
    reqs = _requests(4, 12, base=350)
    clean = _clean(reference, reqs)
    before = _counters(scheduler)
    assert _clean(scheduler, reqs) == clean  # no error: recomputed where it went
    after = _counters(scheduler)
    assert after["tandem:kv_transfer_failures_total"] - before["tandem:kv_transfer_failures_total"] == len(reqs)
    assert after["tandem:requests_migrated_total"] == before["tandem:requests_migrated_total"]
    assert after["tandem:tokens_recomputed_total"] > before["tandem:tokens_recomputed_total"]
    wait_kv_free(decode.stub)


def test_hand_offs_go_to_a_decode_executor_of_the_same_kv_layout_never_to_a_tensor_parallel_one(
        request, model_dir, roles, reference):
    prefill, decode = roles
    tp2 = start_for(request, model_dir, "--role", "decode", "--tensor-parallel-size", "2", "--threads", "1", *KV)
    reqs = _requests(4, 12, base=420)
    clean = _clean(reference, reqs)
    # Only the TP=2 executor decodes: no hand-off at all, the prompt's executor decodes (its own tokens).
    alone = start_scheduler_for(request, prefill.address, "--executor", tp2.address, "--metrics-port", "0")
    before = (_sampled(prefill), _sampled(tp2), _counters(alone))
    assert _clean(alone, reqs) == clean
    after = _counters(alone)
    assert _sampled(prefill) - before[0] == len(reqs) * 12 and _sampled(tp2) == before[1]
    for name in ("kv_transfer_failures", "requests_migrated", "tokens_recomputed"):
        assert after[f"tandem:{name}_total"] == before[2][f"tandem:{name}_total"], name
    # Beside a decode executor of the prefill executor's layout: every hand-off goes there, none fails.
    both = start_scheduler_for(request, prefill.address, "--executor", tp2.address, "--executor", decode.address,
                               "--metrics-port", "0")
    before = (_sampled(tp2), _sampled(decode), _counters(both))
    assert _clean(both, reqs) == clean
    after = _counters(both)
    assert _sampled(tp2) == before[0] and _sampled(decode) - before[1] == len(reqs) * 11
    assert after["tandem:requests_migrated_total"] - before[2]["tandem:requests_migrated_total"] == len(reqs)
    assert after["tandem:kv_transfer_failures_total"] == before[2]["tandem:kv_transfer_failures_total"]
    for ex in (prefill, decode, tp2):
        wait_kv_free(ex.stub)


def test_a_scheduler_killed_while_transfers_run_leaks_no_block(request, roles):
    prefill, decode = roles
    scheduler = start_scheduler(prefill.address, "--executor", decode.address)
    try:
        reqs = _requests(16, 200, base=220)
        calls = [scheduler.stub.Generate(r, timeout=60) for r in reqs]
        for c in calls[:4]:
            next(c)  # hand-offs are under way
        scheduler.process.kill()
        for c in calls:
            c.cancel()
    finally:
        scheduler.process.kill()
        scheduler.channel.close()
    # Whatever it held (caches on both, an import half done) is freed when its session's lease ends (3 s)
    wait_kv_free(prefill.stub, timeout=20)
    wait_kv_free(decode.stub, timeout=20)


def test_a_drained_executors_streams_move_with_their_kv_and_it_exits_at_once(pair, reference):
    reqs = _requests(8, 80)
    clean = _clean(reference, reqs)
    before = _counters(pair.scheduler)
    on_a = _sampled(pair.a)
    calls = [pair.scheduler.stub.Generate(r, timeout=120) for r in reqs]
    firsts = [next(c) for c in calls]  # every stream is running, on both executors
    assert _sampled(pair.a) > on_a, "no stream runs on A"
    signalled = time.monotonic()
    pair.a.send_sigterm()
    assert pair.a.wait_exit() == 0, pair.a.stderr()
    exited_s = time.monotonic() - signalled
    got = [_rest(c, f) for c, f in zip(calls, firsts)]  # no error: a pause at most
    assert got == clean  # greedy and seeded: exactly the undisturbed tokens
    after = _counters(pair.scheduler)
    moved = after["tandem:requests_migrated_total"] - before["tandem:requests_migrated_total"]
    assert moved > 0, pair.scheduler.stderr()[-3000:]
    assert after["tandem:tokens_recomputed_total"] == before["tandem:tokens_recomputed_total"]
    assert after["tandem:kv_transfer_failures_total"] == before["tandem:kv_transfer_failures_total"]
    assert after["tandem:kv_transfer_bytes_total"] > before["tandem:kv_transfer_bytes_total"]
    assert exited_s < 8, f"the drained executor took {exited_s:.1f} s to exit"
    wait_kv_free(pair.b.stub)
    pair.restart_a()


def test_sigkill_of_the_source_as_it_drains_loses_no_stream(pair, reference):
    reqs = _requests(8, 64, base=90)
    clean = _clean(reference, reqs)
    calls = [pair.scheduler.stub.Generate(r, timeout=120) for r in reqs]
    firsts = [next(c) for c in calls]
    pair.a.send_sigterm()  # the scheduler starts moving A's streams ...
    time.sleep(0.03)
    pair.a.process.kill()  # ... and A dies under the transfers (or before them: a plain loss)
    got = [_rest(c, f) for c, f in zip(calls, firsts)]
    assert got == clean  # every stream ends, with the undisturbed tokens: moved or recomputed
    wait_kv_free(pair.b.stub)


def test_an_executor_draining_with_nowhere_to_move_finishes_its_streams_first(request, model_dir):
    alone = start_executor(model_dir, *KV)
    try:
        scheduler = start_scheduler_for(request, alone.address)
        reqs = _requests(4, 120, base=400)
        clean = _clean(scheduler, reqs)
        calls = [scheduler.stub.Generate(r, timeout=120) for r in reqs]
        firsts = [next(c) for c in calls]
        alone.send_sigterm()  # no other executor: it serves its sessions' streams to their end, then exits
        got = [_rest(c, f) for c, f in zip(calls, firsts)]
        assert got == clean  # no error, nothing recomputed: the streams ended where they ran
        assert alone.wait_exit() == 0, alone.stderr()
        assert "draining: waiting" in alone.stderr()
    finally:
        alone.process.kill()
        alone.channel.close()
