"""--deterministic with real processes: the same requests give bit-identical tokens AND logprobs
(top-5 alternatives included) through the scheduler, whatever happened around them.

32 requests over the tiny Llama (half greedy, half seeded sampling at temperature 1 with top-k and top-p;
prompts of 5 to 90 tokens, some with repeats for n-gram drafts), each first alone on an idle executor: the
reference. Then, every one compared to it whole (every streamed token, logprob and alternative):
- all 32 at once;
- prompt chunks of 16 and of 64 (the scheduler's --prefill-chunk) on the same executor;
- speculation on (--speculative ngram: drafts are proposed and some accepted);
- a KV pool so small that requests are preempted and recomputed (usage.preemptions > 0);
- the executor SIGKILLed mid-run and restarted on its address (streams pause, recompute, finish);
- a fleet of two executors, one SIGKILLed mid-run: the other takes its requests over.
GetInfo and the scheduler's GET /v1/models say the executors are deterministic.
The default run generates 16 tokens per request; `--long` runs the issue's 64.
"""
from __future__ import annotations

import concurrent.futures as cf
import random
import socket

import httpx
import pytest

from models.decode.native import machine_refusal
from tandem import server_process
from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_executor, start_scheduler_for
from tests.scheduler_client import Streamed, collect, ids_request, wait_kv_free

pytestmark = pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernel: {machine_refusal()}")

N = 32
VOCAB = 400  # the tiny tokenizer's real ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(n: int) -> list[int]:
    rng = random.Random(n)
    length = 5 + (n * 37) % 86  # 5 .. 90
    if n % 3 == 0:  # repeats: n-gram drafts find matches
        motif = [rng.randrange(3, VOCAB) for _ in range(4)]
        return [1] + (motif * length)[:length]
    return [1] + [rng.randrange(3, VOCAB) for _ in range(length)]


def requests(tokens: int) -> list[pb.GenerateRequest]:
    out = []
    for n in range(N):
        sampling = None if n % 2 == 0 else cpb.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1000 + n)
        stop = pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True)
        out.append(ids_request(_prompt(n), tokens, stopping=stop, sampling=sampling, top_logprobs=5))
    return out


def answer(got: Streamed) -> tuple:
    """What must be identical: every token, its logprob and its alternatives, bit for bit (proto floats)."""
    return tuple(got.token_ids), tuple(lp.SerializeToString() for lp in got.logprobs), got.text


def together(stub, reqs: list[pb.GenerateRequest]) -> list[Streamed]:
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: collect(stub, r, timeout=300), reqs))


def assert_same(got: list[Streamed], ref: list[tuple], what: str) -> None:
    bad = [n for n, (g, r) in enumerate(zip(got, ref)) if answer(g) != r]
    assert not bad, f"{what}: requests {bad} differ from their run alone"


def mid_run(stub, reqs: list[pb.GenerateRequest], act) -> list[Streamed]:
    """Starts every request, waits for each stream's first message, calls act(), then reads the rest."""
    calls = [stub.Generate(r, timeout=300) for r in reqs]
    firsts = [next(c) for c in calls]
    act()
    out = []
    for first, call in zip(firsts, calls):
        s = Streamed()
        for msg in [first, *call]:
            s.token_ids += list(msg.token_ids)
            s.logprobs += list(msg.logprobs)
            s.text += msg.text
            s.usage = msg.usage if msg.HasField("usage") else s.usage
        out.append(s)
    return out


class Setup:
    def __init__(self, request, model_dir, tokens: int) -> None:
        self.request, self.model, self.tokens = request, model_dir, tokens
        self.port = _free_port()
        self.executor = self.start_executor(self.port, "--kv-blocks", "256")
        self.scheduler = start_scheduler_for(request, self.executor.address, "--http-port", "0")
        self.reqs = requests(tokens)
        self.ref = [answer(collect(self.scheduler.stub, r, timeout=300)) for r in self.reqs]

    def start_executor(self, port: int, *args: str):
        """A --deterministic executor, closed at the end unless it was killed."""
        server = start_executor(self.model, "--deterministic", "--port", str(port), *args)
        self.request.addfinalizer(lambda: server.close() if server.proc.poll() is None else server.channel.close())
        return server


def _run_all(setup: Setup) -> None:
    s, reqs, ref = setup, setup.reqs, setup.ref
    info = s.executor.stub.GetInfo(epb.GetInfoRequest())
    assert info.deterministic and "deterministic" in info.capabilities
    cards = httpx.get(f"{s.scheduler.process.http_url}/v1/models", timeout=30).json()["data"]
    assert [c["deterministic"] for c in cards] == [True]  # the scheduler says so too

    assert_same(together(s.scheduler.stub, reqs), ref, "all together")
    for chunk in ("16", "64"):
        chunked = start_scheduler_for(s.request, s.executor.address, "--prefill-chunk", chunk)
        assert_same(together(chunked.stub, reqs), ref, f"prompt chunks of {chunk}")
        chunked.close()

    spec = start_scheduler_for(s.request, s.executor.address, "--speculative", "ngram", "--speculative-max-batch", "64")
    got = together(spec.stub, reqs)
    assert sum(g.usage.drafted_tokens for g in got) > 0 and sum(g.usage.accepted_tokens for g in got) > 0
    assert_same(got, ref, "speculation on")
    spec.close()
    wait_kv_free(s.executor.stub)

    small = s.start_executor(0, "--kv-blocks", "14")  # 224 slots; the 32 together need ~10x that
    small_sch = start_scheduler_for(s.request, small.address, "--speculative", "off")  # (preemption, not drafts)
    got = together(small_sch.stub, reqs)
    assert sum(g.usage.preemptions for g in got) > 0, "the pool was meant to force preemption"
    assert_same(got, ref, "preempted and recomputed")
    small_sch.close()
    small.close()

    def kill_and_restart():
        s.executor.process.kill()  # SIGKILL: every cache gone
        s.executor = s.start_executor(s.port, "--kv-blocks", "256")

    assert_same(mid_run(s.scheduler.stub, reqs, kill_and_restart), ref, "executor SIGKILLed and restarted")

    a, b = s.start_executor(0, "--kv-blocks", "128"), s.start_executor(0, "--kv-blocks", "128")
    fleet = start_scheduler_for(s.request, a.address, "--executor", b.address)
    assert_same(mid_run(fleet.stub, reqs, a.process.kill), ref, "the fleet's second executor taking over")


def test_bit_identical_across_batching_chunking_preemption_restart_speculation_and_failover(request, model_dir):
    _run_all(Setup(request, model_dir, tokens=16))


@pytest.mark.long
def test_the_issues_32_by_64(request, model_dir):
    _run_all(Setup(request, model_dir, tokens=64))


@pytest.mark.parametrize("flags, words", [(("--adapter-root", "{tmp}"), "--deterministic: LoRA adapters"),
                                          (("--tensor-parallel-size", "2"), "--deterministic: --tensor-parallel-size")])
def test_refused_at_start_before_loading(tmp_path, model_dir, flags, words):
    args = [f.format(tmp=tmp_path) for f in flags]
    done = server_process.run_to_exit("executor_service", "--model", str(model_dir), "--deterministic", *args,
                                      "--port", "0", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert words in done.stderr and str(tmp_path) not in done.stderr
