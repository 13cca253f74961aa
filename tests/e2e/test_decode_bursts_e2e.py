"""Multi-step decode with real processes (tiny llama): two schedulers on one executor, one with bursts (the
default) and one with --decode-burst-ms 0, stream the same greedy, seeded, penalised and stop-string
requests token for token, text and logprobs alike; the bursts really are Decode calls of several steps
(several tokens per message); a request arriving while another streams in bursts is served with its own
tokens; a stream cancelled mid-burst frees its cache; a burst the executor refuses for its reply size fails
no request (the scheduler goes on with shorter bursts)."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import cancel_stream, collect, ids_request, wait_kv_free

LONG = pb.StoppingCriteria(max_new_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def executor(request, model_dir):
    # Replies of at most 1 MiB: far above what the bursts of 8 steps below send; the last test's long
    # bursts go over it.
    return start_for(request, model_dir, "--kv-blocks", "400", "--max-message-mb", "1")


@pytest.fixture(scope="module")
def bursts(request, executor):
    return start_scheduler_for(request, executor.address, "--decode-burst-ms", "60000", "--max-decode-steps", "8")


@pytest.fixture(scope="module")
def single(request, executor):
    return start_scheduler_for(request, executor.address, "--decode-burst-ms", "0")


def requests() -> list[pb.GenerateRequest]:
    return [ids_request([1, 7, 8, 9], 60, stopping=LONG),
            ids_request([1, 300, 22, 9, 41], 60, stopping=LONG, top_logprobs=2,
                        sampling=cpb.SamplingParams(temperature=0.9, top_k=40, seed=11)),
            ids_request([1, 50, 60], 45, stopping=pb.StoppingCriteria(max_new_tokens=45, ignore_eos=True),
                        sampling=cpb.SamplingParams(presence_penalty=0.7, frequency_penalty=0.5)),
            ids_request([1, 2, 3, 4, 5], 40, stopping=pb.StoppingCriteria(max_new_tokens=40))]


def decode_calls(executor) -> int:
    return executor.stub.GetMetrics(epb.GetMetricsRequest()).rpcs["Decode"].count


def test_bursts_stream_what_single_steps_stream(executor, bursts, single):
    with cf.ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda r: collect(single.stub, r), requests()))
    before = decode_calls(executor)
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: collect(bursts.stub, r), requests()))
    assert decode_calls(executor) > before
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-5)
        assert [[t.token_id for t in lp.top_logprobs] for lp in g.logprobs] == \
            [[t.token_id for t in lp.top_logprobs] for lp in w.logprobs]
    assert max(len(m.token_ids) for m in got[0].messages) > 1  # a burst is one message
    assert max(len(m.token_ids) for m in want[0].messages) == 1
    # a stop string inside a burst: the text ends where it ends with single steps
    text = want[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    req = ids_request([1, 7, 8, 9], 60, stopping=pb.StoppingCriteria(max_new_tokens=60, ignore_eos=True, stop=[stop]))
    a, b = collect(single.stub, req), collect(bursts.stub, req)
    assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
    assert b.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and b.text == text[:text.index(stop)]
    wait_kv_free(executor.stub)


def test_a_request_arriving_during_bursts_and_a_cancel_mid_burst(executor, bursts, single):
    long = ids_request([1, 9, 9, 9], 200, stopping=pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True))
    late = ids_request([1, 44, 45], 20, stopping=pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True))
    want_long, want_late = collect(single.stub, long), collect(single.stub, late)
    call = bursts.stub.Generate(long, timeout=120)
    first = [next(call), next(call), next(call)]  # the prompt's token, then bursts
    assert sum(len(m.token_ids) for m in first[1:]) > 2
    assert collect(bursts.stub, late).token_ids == want_late.token_ids
    seen = [t for m in first for t in m.token_ids]
    assert seen == want_long.token_ids[:len(seen)]
    cancel_stream(call)
    wait_kv_free(executor.stub)


# ----------------------------------------------------------- a burst whose reply the executor cannot send


@pytest.fixture(scope="module")
def long_bursts(request, executor):
    return start_scheduler_for(request, executor.address, "--decode-burst-ms", "60000", "--max-decode-steps", "256")


def test_a_burst_refused_for_its_reply_size_fails_no_request(executor, long_bursts, single):
    """24 streams of 200 tokens with 20 alternatives each on the 1-MiB executor: one step's reply is ~20 KB, a
    first burst of ~199 steps could reach ~1.6 MB (the executor counts every step at its bound) and is refused
    before it runs (RESOURCE_EXHAUSTED). The scheduler halves its cap and goes on: every stream ends as with
    single steps."""
    bursts = long_bursts
    stop = pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True)
    reqs = [ids_request([1, 10 + i, 20 + 2 * i, 7], 200, stopping=stop, top_logprobs=20) for i in range(24)]
    with cf.ThreadPoolExecutor(24) as pool:
        want = list(pool.map(lambda r: collect(single.stub, r), reqs))
    with cf.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda r: collect(bursts.stub, r), reqs))
    assert "the executor refused a" in bursts.process.log() and "at most" in bursts.process.log()
    assert executor.stub.GetMetrics(epb.GetMetricsRequest()).rpcs["Decode"].count > 0  # bursts went on
    for w, g in zip(want, got):
        assert len(g.token_ids) == 200 and all(len(lp.top_logprobs) == 20 for lp in g.logprobs)
        assert g.token_ids == w.token_ids
    wait_kv_free(executor.stub)
