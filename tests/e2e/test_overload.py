"""Overload with real processes (an executor over a tiny random Llama, schedulers with one or two batch places and
--max-queue-time-s 1): a request that waits in the queue past the bound is refused — HTTP 429 with an OpenAI
error body and `Retry-After` (streamed or not: the status line waits for the admission), gRPC RESOURCE_EXHAUSTED
with `retry-after` and `grpc-retry-pushback-ms` trailers — and counted by reason; a flood is answered, each
request either run to its end or refused before any token, and the executor's KV is all free after.
The rules themselves on a hand clock: tests/scheduler/test_overload_admission.py; figures at 2-10x capacity:
`python -m benchmarks overload`."""
from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest

from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_prometheus_metrics import scrape
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import ids_request, wait_kv_free

PROMPT = [1, 5, 9, 13]


def long_request(max_new: int) -> pb.GenerateRequest:
    return ids_request(PROMPT, max_new, stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True))


@pytest.fixture(scope="module")
def executor(request, tiny_checkpoint):
    model = tiny_checkpoint("llama", config_overrides={"max_position_embeddings": 8192})
    return start_for(request, model, "--kv-blocks", "1200")


def scheduler_for(request, executor, *args: str):
    return start_scheduler_for(request, executor.address, "--http-port", "0", "--metrics-port", "0",
                               "--speculative", "off", "--max-queue-time-s", "1", *args)


def refusals(scheduler) -> dict[str, float]:
    samples = scrape(scheduler)
    return {reason: samples.get(f'tandem:requests_refused_total{{reason="{reason}"}}', 0.0)
            for reason in ("queue_full", "queue_wait_estimate", "queue_time", "rpc_limit")}


def assert_retry_after(value: str | None) -> int:
    assert value is not None and value.isdigit() and int(value) >= 1, value  # whole seconds (RFC 9110)
    return int(value)


def test_a_request_not_admitted_within_the_bound_is_429_or_resource_exhausted_with_retry_after(request, executor):
    scheduler = scheduler_for(request, executor, "--max-running", "1")
    url = scheduler.process.http_url
    blocker = scheduler.stub.Generate(long_request(6000), timeout=120)
    try:
        next(blocker)  # it holds the one place in the batch: whatever comes next waits in the queue
        with httpx.Client(base_url=url, timeout=30) as http:
            whole = http.post("/v1/completions", json={"model": "", "prompt": "a b", "max_tokens": 4})
            assert whole.status_code == 429, whole.text
            assert_retry_after(whole.headers.get("retry-after"))
            error = whole.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted"
            assert "not admitted within 1 s (--max-queue-time-s)" in error["message"]
            body = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as streamed:  # no 200 and an error event
                assert streamed.status_code == 429 and streamed.headers["content-type"] == "application/json"
                assert_retry_after(streamed.headers.get("retry-after"))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError) as caught:  # the OpenAI client's own reading of it
            client.completions.create(model="", prompt="a b", max_tokens=4)
        assert_retry_after(caught.value.response.headers.get("retry-after"))

        call = scheduler.stub.Generate(ids_request(PROMPT, 4), timeout=30)
        with pytest.raises(grpc.RpcError) as failed:
            list(call)  # nothing streamed before the refusal
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue-time-s" in failed.value.details()
        trailers = dict(failed.value.trailing_metadata())
        seconds = assert_retry_after(trailers.get("retry-after"))
        assert trailers.get("grpc-retry-pushback-ms") == str(seconds * 1000)
    finally:
        blocker.cancel()
    assert refusals(scheduler)["queue_time"] == 4
    wait_kv_free(executor.stub)


def _run_grpc(scheduler, outcomes: list, max_new: int) -> None:
    """One Generate, classified: ("done", tokens) or ("refused", messages before it, trailers)."""
    tokens, messages = 0, 0
    try:
        for msg in scheduler.stub.Generate(long_request(max_new), timeout=120):
            messages += 1
            tokens += len(msg.token_ids)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                outcomes.append(("done", tokens, msg.finish_reason))
                return
        outcomes.append(("ended without a finish", tokens, None))
    except grpc.RpcError as exc:
        trailers = dict(exc.trailing_metadata() or ())
        outcomes.append(("refused" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else exc.code().name,
                         messages, trailers.get("retry-after")))


def _run_http(url: str, outcomes: list, max_new: int) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": "", "prompt": [PROMPT], "max_tokens": max_new,
                                               "ignore_eos": True, "temperature": 0})
    if r.status_code == 200:
        outcomes.append(("done", r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]))
    else:
        outcomes.append(("refused" if r.status_code == 429 else str(r.status_code), 0, r.headers.get("retry-after")))


def test_a_flood_is_refused_fast_and_every_admitted_request_runs_to_its_end(request, executor):
    """24 requests at once (gRPC and HTTP) at a scheduler with 2 places: each either runs all its tokens or is
    refused before any (its wait, estimated from the drain rate the first request measured, past the bound; or
    the bound reached in the queue), with a Retry-After; the refusals are counted by reason; the executor's KV
    is all free after. The drain rate is measured first from a request cancelled after 1.5 s in the batch: with
    2 places that is ~1.3 requests a second, so a request with one queued ahead of it would wait past 1 s."""
    scheduler = scheduler_for(request, executor, "--max-running", "2", "--max-waiting", "64")
    max_new = 96
    first = scheduler.stub.Generate(long_request(6000), timeout=60)
    t0 = time.monotonic()
    for _ in first:  # 1.5 s in the batch, then cancelled: the drain rate the estimates use
        if time.monotonic() - t0 > 1.5:
            break
    first.cancel()
    outcomes: list = []
    threads = [threading.Thread(target=_run_grpc, args=(scheduler, outcomes, max_new)) for _ in range(12)]
    threads += [threading.Thread(target=_run_http, args=(scheduler.process.http_url, outcomes, max_new))
                for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(outcomes) == 24
    done = [o for o in outcomes if o[0] == "done"]
    refused = [o for o in outcomes if o[0] == "refused"]
    assert len(done) + len(refused) == 24, outcomes  # no other ending (no 5xx, no CANCELLED)
    assert done and refused, outcomes
    assert all(o[1] == max_new and o[2] in (pb.FINISH_REASON_LENGTH, "length") for o in done), done
    assert all(o[1] == 0 for o in refused), refused  # never half-run
    for o in refused:
        assert_retry_after(o[2])
    counted = refusals(scheduler)
    assert sum(counted.values()) == len(refused) and counted["queue_wait_estimate"] >= 1, counted
    wait_kv_free(executor.stub)


@pytest.fixture(scope="module")
def slow_executor(request, tiny_checkpoint):
    """A wider tiny Llama (hidden 1024, 4 layers: ~25-40 ms a decode step on 2 cores), so that one call of
    many decode steps lasts seconds."""
    model = tiny_checkpoint("llama", num_layers=4, config_overrides={
        "max_position_embeddings": 8192, "hidden_size": 1024, "intermediate_size": 2048,
        "num_attention_heads": 8, "num_key_value_heads": 4})
    return start_for(request, model, "--kv-blocks", "600", "--threads", "1")


@pytest.mark.serial  # (it measures time)
def test_at_heavy_overload_no_request_waits_past_its_bound_even_behind_a_long_step(request, slow_executor):
    """The queue bound is kept on time, not after the step call in flight: one place in the batch, held by a
    request whose decode bursts run for seconds (--decode-burst-ms 4000: one call of many steps, during which
    the loop plans nothing), and 16 more requests at once: every one is refused at --max-queue-time-s (1 s)
    within a stated slack (generous: the machine is shared), never at the end of the burst."""
    scheduler = scheduler_for(request, slow_executor, "--max-running", "1", "--decode-burst-ms", "4000",
                              "--max-decode-steps", "256")
    slack_s = 2.0
    blocker = scheduler.stub.Generate(long_request(4000), timeout=120)
    try:
        for _ in range(3):  # decoding: the next calls are bursts
            next(blocker)
        waited: list = []

        def one() -> None:
            t0 = time.monotonic()
            _run_grpc(scheduler, outcome := [], 4)
            waited.append((outcome[0][0], time.monotonic() - t0))

        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        blocker.cancel()
    assert len(waited) == 16 and all(end == "refused" for end, _ in waited), waited
    late = [round(s, 2) for _, s in waited if s > 1.0 + slack_s]
    assert not late, f"refused later than the 1 s bound + {slack_s} s: {sorted(round(s, 2) for _, s in waited)}"
    assert refusals(scheduler)["queue_time"] == 16
    wait_kv_free(slow_executor.stub)
