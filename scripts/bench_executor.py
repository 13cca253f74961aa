#!/usr/bin/env python
"""Decode-step latency: the in-process Executor vs the same Executor behind gRPC (a real server process).

The script starts `python -m executor_service --port 0` on the same model, with the same --threads, device
and dtype as the in-process `Executor` it builds itself, and drives both with the same random prompts
(fixed seed). Both processes exist at once; while one side is timed the other is idle.

Configurations (each at every --batches size B, greedy sampling):

- tokens:      output mode TOKENS, num_steps 1 (the sampled token and its logprob come back);
- logits/f32:  output mode LOGITS, num_steps 1; gRPC returns float32 logits (B x vocab x 4 bytes);
- logits/bf16: the same with LOGITS_DTYPE_BFLOAT16 over the wire (half the bytes). The in-process API has
               no wire dtype: that side is the same call as logits/f32 (float32 tensors, nothing encoded);
- tokens/x8:   output mode TOKENS, num_steps --multi-steps (8): one call runs 8 steps, feeding each sampled
               token back inside the executor. ms/step = call time / 8; `xN/x1` = that per-token time over
               the tokens row's (num_steps 1) per-step time at the same batch, per side. Each timed call
               advances 8 positions, so these steps attend to longer contexts than the tokens row's; the
               in-process xN/x1 measures that effect alone, and `g/i` = grpc xN/x1 / inproc xN/x1 is what
               amortising the round trip over 8 steps buys gRPC (< 1: it helps).

Per configuration and side: prefill B prompts of --context tokens (untimed, UnifiedDecode in calls of at
most --max-batch-tokens tokens), --warmup untimed steps, then --steps timed calls, feeding the sampled
token (logits modes: the argmax of the returned logits, computed outside the timed region on both sides)
back; then the caches are released. The two sides' calls alternate (in-process first on even steps,
gRPC first on odd ones), so a noisy, shared machine slows both alike: compare the ratios of one run, not
absolute times across runs.

What one timed call covers, on each side (the same client work, so the ratio is fair):
- in-process: building the B `DecodeItem`s from the previous step's (cache id, length, token) +
  `Executor.decode()` + reading the results (token ids and lengths; logits modes: the float32 tensors);
- gRPC: building the `DecodeRequest` message from the same state (client-side request construction is
  part of the gRPC cost and is timed) + `stub.Decode()` (serialisation, loopback round trip, the server's
  interceptor, codec and executor, response parsing) + reading the response (token ids and lengths;
  logits modes: `codec.decode_logits` of every row into a float32 array, as a client needs them).
Columns: ms/step = median call time / num_steps; grpc/inproc = ratio of the medians (min ratio: of the
fastest calls, steadier when other jobs share the machine); resp bytes = the serialised DecodeResponse;
tok/s = B x num_steps / median call time.

Where gRPC time goes (the breakdown table, means over the timed calls, ms per call): `grpc-inproc` = the
difference of the mean call times, split into `op diff` = the server's executor decode time
(GetMetrics operations["decode"]) minus the in-process one (the same work in two processes), `servicer`
= the server's interceptor-timed handler time (rpcs["Decode"]) minus its executor time (codec proto <->
domain, response building, logits encoding), `transport` = the client's stub.Decode time minus the
handler time (request/response (de)serialisation on both ends, loopback channel, gRPC threads) and
`client diff` = the gRPC client's request building + response reading minus the in-process side's.
`serde (micro)` / `codec (micro)` time those pieces alone in this process on the last call's messages
(JSON `micro_ms`); JSON `empty_rpc` is the round trip of an empty ReleaseCache (channel + interceptor +
gRPC's per-call cost without payload), `interceptor_overhead_ms` the interceptor wrapper alone.
`inproc cpu` / `srv cpu`: CPU ms per call of this process (process time) and of the server (/proc, all
threads); `cores`: that CPU time per wall-clock second of the side's calls; `inproc thr` / `srv thr`:
threads that used >= 10% of the side's timed wall time. JSON `other_processes_cores`: cores other processes
kept busy during the row's timed calls (/proc/stat; null for windows under 2 s); above 0.25 a note flags
the row, as its ratios are not the idle-machine ones.

Reading `op diff`: torch's CPU ops run on OpenMP (libgomp), and every thread that has run model ops owns
its own team of T - 1 worker threads for as long as it lives. The server therefore runs load, warm-up and
every RPC's model work on one dedicated thread (executor_service/model_thread.py); `srv thr` <= T confirms
it. Before that fix the server's extra idle teams made libgomp park its workers instead of spinning, and
`op diff` showed a ~18 % slower step for the same CPU time.

    python scripts/bench_executor.py                        # SmolLM2-135M-Instruct (prepared if needed)
    python scripts/bench_executor.py --quick --model /tmp/tiny-llama
    python scripts/bench_executor.py --batches 32 --configs tokens --steps 32

Benchmark-only; never imported by the servers.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# OpenMP wait policy of both sides (the server subprocess inherits the environment); it must be set before
# torch is imported, hence this look at argv ahead of argparse. Default: whatever the environment says
# (libgomp's own default when unset: spin ~3 ms, then sleep), as a server started by hand runs. `passive`
# makes every libgomp worker sleep between parallel regions on both sides.
OMP_WAIT_POLICIES = ("passive", "active", "unset")


def _omp_wait_policy(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1].lower()
        if a.startswith("--omp-wait-policy="):
            return a.split("=", 1)[1].lower()
    return None


_POLICY_ARG = _omp_wait_policy(sys.argv[1:]) if __name__ == "__main__" else None
if _POLICY_ARG == "unset":
    os.environ.pop("OMP_WAIT_POLICY", None)
elif _POLICY_ARG in OMP_WAIT_POLICIES:
    os.environ["OMP_WAIT_POLICY"] = _POLICY_ARG.upper()
# no flag (or a bad one: argparse reports it): the environment's policy

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
for p in (str(ROOT), str(SCRIPTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_common as bc  # noqa: E402
from executor_service import codec  # noqa: E402
from executor_service.config import ExecutorConfig  # noqa: E402
from executor_service.executor import Executor  # noqa: E402
from executor_service.interceptor import ErrorMappingInterceptor, RpcMetrics  # noqa: E402
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem  # noqa: E402
from models.kv_cache import DEFAULT_BLOCK_SIZE  # noqa: E402
from tandem.executor.v1 import executor_pb2 as pb  # noqa: E402
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc  # noqa: E402

MAX_MESSAGE_MB = 64  # the server's default --max-message-mb
QUICK = {"batches": "1,4", "steps": 3, "warmup": 1, "context": 16, "empty_rpcs": 20, "micro_repeats": 5}
DEFAULTS = {"batches": "1,8,32,64", "steps": 16, "warmup": 2, "context": 128, "empty_rpcs": 200,
            "micro_repeats": 20}


@dataclass(frozen=True)
class Config:
    name: str
    mode: OutputMode
    pb_mode: int
    logits_dtype: int  # wire dtype (gRPC side only)
    num_steps: int

    @property
    def wants_tokens(self) -> bool:
        return self.mode is not OutputMode.LOGITS


def make_configs(multi_steps: int) -> dict[str, Config]:
    return {c.name: c for c in (
        Config("tokens", OutputMode.TOKENS, pb.OUTPUT_MODE_TOKENS, pb.LOGITS_DTYPE_FLOAT32, 1),
        Config("logits/f32", OutputMode.LOGITS, pb.OUTPUT_MODE_LOGITS, pb.LOGITS_DTYPE_FLOAT32, 1),
        Config("logits/bf16", OutputMode.LOGITS, pb.OUTPUT_MODE_LOGITS, pb.LOGITS_DTYPE_BFLOAT16, 1),
        Config(f"tokens/x{multi_steps}", OutputMode.TOKENS, pb.OUTPUT_MODE_TOKENS, pb.LOGITS_DTYPE_FLOAT32,
               multi_steps),
    )}


def log(msg: str) -> None:
    print(f"[bench_executor] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
    ap.add_argument("--batches", default=None, help=f"decode batch sizes (default {DEFAULTS['batches']})")
    ap.add_argument("--context", type=int, default=None,
                    help=f"tokens per sequence before decoding (default {DEFAULTS['context']})")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"timed decode calls per side and configuration (default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed decode calls first (default {DEFAULTS['warmup']})")
    ap.add_argument("--multi-steps", type=int, default=8, help="num_steps of the multi-step configuration (default 8)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated subset of: tokens, logits/f32, logits/bf16, tokens/xN (default: all)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(bc.DTYPES), help="default float32")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each side (the server gets --threads T; default: every usable core)")
    ap.add_argument("--omp-wait-policy", choices=OMP_WAIT_POLICIES, type=str.lower, default=None,
                    help="OMP_WAIT_POLICY of both sides: passive, active, or unset = libgomp's default "
                         "(default: the environment's, i.e. as a server started by hand runs)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="both sides' per-call token limit (default 8192)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--empty-rpcs", type=int, default=None, help="timed empty RPCs for the baseline round trip")
    ap.add_argument("--micro-repeats", type=int, default=None, help="repeats of each serialisation micro-timing")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for the server's READY")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_executor.json"), help="JSON results file")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: batches 1,4; steps 3; warmup 1; context 16 (explicit flags still win)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.batch_list = bc.int_list(args.batches, "--batches")
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.multi_steps < 2:
        ap.error("--context and --steps must be >= 1, --warmup >= 0, --multi-steps >= 2")
    if args.empty_rpcs < 1 or args.micro_repeats < 1:
        ap.error("--empty-rpcs and --micro-repeats must be >= 1")
    all_configs = make_configs(args.multi_steps)
    names = [n.strip() for n in args.configs.split(",") if n.strip()] if args.configs else list(all_configs)
    unknown = [n for n in names if n not in all_configs]
    if unknown or not names:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(all_configs)}")
    args.config_list = [all_configs[n] for n in names]
    return args


# --------------------------------------------------------------------------------------------- server
class ServerProcess:
    """`python -m executor_service` as a child process; `stop()` is idempotent and also runs at exit."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.address: str | None = None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        atexit.register(self.stop)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name="server-stdout", daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the executor server printed no READY line within {timeout:.0f}s")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"the executor server exited (code {self.proc.wait()}) before READY; "
                                   "its log is above")
            if line.startswith("READY "):
                addresses = line.split()[1:]
                self.address = next((a for a in addresses if not a.startswith("unix:")), addresses[0])
                return self.address

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server drains and exits 0
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if this benchmark dies without running its cleanup (SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# --------------------------------------------------------------------------------------------- sides
def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low = min(3, vocab - 1)  # skip the usual special ids (pad/bos/eos)
    return torch.randint(low, vocab, (batch, length), generator=gen).tolist()


def groups_of(prompts: list[list[int]], limit: int) -> list[list[list[int]]]:
    groups, cur, size = [], [], 0
    for p in prompts:
        if cur and size + len(p) > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += len(p)
    groups.append(cur)
    return groups


class Side:
    """State of B sequences on one side: cache ids, lengths and the token to feed next."""
    name = ""

    def __init__(self) -> None:
        self.caches: list[str] = []
        self.lengths: list[int] = []
        self.tokens: list[int] = []
        self.clock: bc.Clock | None = None
        self.parts: dict[str, list[float]] = {}
        self.history: list[list[int]] = []  # tokens fed back after each timed call (sanity check)

    def reset_timing(self, device: torch.device) -> None:
        self.clock = bc.Clock(device)
        self.parts = {"build": [], "call": [], "read": []}
        self.history = []


TOKENS_ONLY = OutputOptions(OutputMode.TOKENS)


class InProcSide(Side):
    name = "inproc"

    def __init__(self, ex: Executor) -> None:
        super().__init__()
        self.ex = ex
        self.last_results = None

    def prefill(self, prompts: list[list[int]]) -> None:
        for group in groups_of(prompts, self.ex.config.max_batch_tokens):
            for r in self.ex.unified_decode([UnifiedItem(tuple(p), output=TOKENS_ONLY) for p in group]):
                self.caches.append(r.cache.cache_id)
                self.lengths.append(r.cache.seq_len)
                self.tokens.append(r.output.tokens[0].token_id)

    def step(self, cfg: Config, timed: bool) -> None:
        output = OutputOptions(cfg.mode)
        clock = self.clock if timed else bc.Clock(self.ex.device)
        with clock:
            t0 = time.perf_counter()
            items = [DecodeItem(CacheRef(c, n), t, output=output)
                     for c, n, t in zip(self.caches, self.lengths, self.tokens)]
            t1 = time.perf_counter()
            results = self.ex.decode(items, cfg.num_steps)
            t2 = time.perf_counter()
            lengths = [r.cache.seq_len for r in results]
            if cfg.wants_tokens:
                sampled = [r.output.tokens[-1].token_id for r in results]
            else:
                logits = [r.output.logits for r in results]  # [1, vocab] float32 tensors, as the caller gets them
            t3 = time.perf_counter()
        if not cfg.wants_tokens:  # outside the timed region, like the gRPC side's
            sampled = [int(x.argmax()) for x in logits]
        self.lengths, self.tokens, self.last_results = lengths, sampled, results
        if timed:
            self.parts["build"].append(t1 - t0)
            self.parts["call"].append(t2 - t1)
            self.parts["read"].append(t3 - t2)
            self.history.append(sampled)

    def release(self) -> None:
        if self.caches:
            self.ex.release_cache(self.caches)
        self.caches, self.lengths, self.tokens = [], [], []

    def op_stats(self) -> tuple[int, float]:
        s = self.ex.metrics_snapshot().ops.get("decode")
        return (s.count, s.mean_ms * s.count) if s else (0, 0.0)


class GrpcSide(Side):
    name = "grpc"

    def __init__(self, stub: pb_grpc.ExecutorServiceStub, max_batch_tokens: int, device: torch.device,
                 server_pid: int) -> None:
        super().__init__()
        self.stub = stub
        self.server_pid = server_pid
        self.max_batch_tokens = max_batch_tokens
        self.device = device
        self.last_request: pb.DecodeRequest | None = None
        self.last_response: pb.DecodeResponse | None = None

    def prefill(self, prompts: list[list[int]]) -> None:
        out = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS)
        for group in groups_of(prompts, self.max_batch_tokens):
            req = pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(token_ids=p, is_final_chunk=True, output=out)
                                                 for p in group])
            for r in self.stub.UnifiedDecode(req).results:
                self.caches.append(r.cache.cache_id)
                self.lengths.append(r.cache.seq_len)
                self.tokens.append(r.output.tokens[0].token_id)

    def step(self, cfg: Config, timed: bool) -> None:
        clock = self.clock if timed else bc.Clock(self.device)
        with clock:
            t0 = time.perf_counter()
            out = pb.OutputOptions(mode=cfg.pb_mode, logits_dtype=cfg.logits_dtype)
            req = pb.DecodeRequest(num_steps=cfg.num_steps)
            for c, n, t in zip(self.caches, self.lengths, self.tokens):
                req.items.add(cache=pb.CacheRef(cache_id=c, seq_len=n), token_id=t, output=out)
            t1 = time.perf_counter()
            resp = self.stub.Decode(req)
            t2 = time.perf_counter()
            results = resp.results
            lengths = [r.cache.seq_len for r in results]
            if cfg.wants_tokens:
                sampled = [r.output.tokens[-1].token_id for r in results]
            else:
                logits = [codec.decode_logits(r.output.logits) for r in results]  # [1, vocab] float32 arrays
            t3 = time.perf_counter()
        if not cfg.wants_tokens:
            sampled = [int(np.argmax(x)) for x in logits]
        self.lengths, self.tokens = lengths, sampled
        self.last_request, self.last_response = req, resp
        if timed:
            self.parts["build"].append(t1 - t0)
            self.parts["call"].append(t2 - t1)
            self.parts["read"].append(t3 - t2)
            self.history.append(sampled)

    def release(self) -> None:
        if self.caches:
            self.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=self.caches))
        self.caches, self.lengths, self.tokens = [], [], []

    def server_stats(self) -> dict[str, tuple[int, float]]:
        m = self.stub.GetMetrics(pb.GetMetricsRequest())
        op, rpc = m.operations.get("decode"), m.rpcs.get("Decode")
        return {"op": (op.count, op.mean_ms * op.count) if op else (0, 0.0),
                "rpc": (rpc.count, rpc.mean_ms * rpc.count) if rpc else (0, 0.0)}


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, from /proc (Linux; {} elsewhere)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(before: dict[str, float], after: dict[str, float], wall_s: float) -> tuple[float, int]:
    """(CPU seconds, threads that used >= 10% of wall_s) between two thread_cpu_s() snapshots."""
    deltas = [v - before.get(tid, 0.0) for tid, v in after.items()]
    return sum(deltas), sum(d >= 0.1 * wall_s for d in deltas)


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def mean_between(before: tuple[int, float], after: tuple[int, float]) -> float | None:
    """Mean ms of the calls recorded between two (count, total ms) snapshots."""
    n = after[0] - before[0]
    return (after[1] - before[1]) / n if n > 0 else None


# ------------------------------------------------------------------------------------ micro-timings
def time_it(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of fn over `repeats` calls after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def micro_breakdown(inproc: InProcSide, grpc_side: GrpcSide, repeats: int) -> dict[str, float]:
    """The gRPC path's CPU pieces, timed alone in this process on the last call's messages (ms):
    request serialise (client) / parse (server), codec request -> domain, the servicer's response
    building (codec domain -> proto, logits encoding included) from the in-process side's results of the
    same shape, response serialise (server) / parse (client)."""
    req, resp = grpc_side.last_request, grpc_side.last_response
    results = inproc.last_results
    req_bytes, resp_bytes = req.SerializeToString(), resp.SerializeToString()
    items = [codec.decode_item_from_pb(i) for i in req.items]
    ex = inproc.ex

    def build_response() -> pb.DecodeResponse:  # what ExecutorServicer.Decode does after the executor call
        return pb.DecodeResponse(
            results=[pb.DecodeResult(cache=codec.cache_to_pb(r.cache),
                                     output=codec.sequence_output_to_pb(r.output, dtype))
                     for r, (_, dtype) in zip(results, items)],
            kv=codec.kv_usage_to_pb(ex.kv_usage()))

    parts = {
        "req_serialize": lambda: req.SerializeToString(),
        "req_parse": lambda: pb.DecodeRequest.FromString(req_bytes),
        "codec_in": lambda: [codec.decode_item_from_pb(i) for i in req.items],
        "codec_out": build_response,
        "resp_serialize": lambda: resp.SerializeToString(),
        "resp_parse": lambda: pb.DecodeResponse.FromString(resp_bytes),
    }
    out = {k: 1e3 * time_it(fn, repeats) for k, fn in parts.items()}
    out["total"] = sum(out.values())
    return out


def interceptor_overhead_ms(repeats: int = 2000) -> float:
    """Extra ms per call of ErrorMappingInterceptor's wrapper around a no-op unary handler."""
    def noop(request, context):
        return None

    details = type("Details", (), {"method": "/tandem.executor.v1.ExecutorService/Decode",
                                   "invocation_metadata": ()})()
    wrapped = ErrorMappingInterceptor(RpcMetrics()).intercept_service(
        lambda _: grpc.unary_unary_rpc_method_handler(noop), details).unary_unary
    best = []
    for fn in (noop, wrapped):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn(None, None)
            runs.append((time.perf_counter() - t0) / repeats)
        best.append(min(runs))
    return 1e3 * (best[1] - best[0])


def empty_rpc_ms(stub: pb_grpc.ExecutorServiceStub, n: int) -> dict[str, float]:
    """Round trip of ReleaseCache with no ids: channel + gRPC + interceptor + a trivial handler."""
    req = pb.ReleaseCacheRequest()
    for _ in range(min(10, n)):
        stub.ReleaseCache(req)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        stub.ReleaseCache(req)
        times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "calls": n}


# --------------------------------------------------------------------------------------------- bench
def stats(times: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "mean_s": statistics.fmean(times), "times_s": times}


def bench_config(inproc: InProcSide, grpc_side: GrpcSide, cfg: Config, batch: int, vocab: int, args,
                 device: torch.device) -> dict[str, Any]:
    prompts = make_prompts(batch, args.context, vocab, args.seed + batch)
    try:
        inproc.prefill(prompts)
        grpc_side.prefill(prompts)
        first_agree = inproc.tokens == grpc_side.tokens
        for step in range(args.warmup):
            for side in ((inproc, grpc_side) if step % 2 == 0 else (grpc_side, inproc)):
                side.step(cfg, timed=False)
        inproc.reset_timing(device)
        grpc_side.reset_timing(device)
        op0, srv0 = inproc.op_stats(), grpc_side.server_stats()
        load0, busy0, wall0 = loadavg(), bc.machine_busy_s(), time.perf_counter()
        threads0 = (thread_cpu_s(os.getpid()), thread_cpu_s(grpc_side.server_pid))
        for step in range(args.steps):  # alternate who goes first
            for side in ((inproc, grpc_side) if step % 2 == 0 else (grpc_side, inproc)):
                side.step(cfg, timed=True)
        threads1 = (thread_cpu_s(os.getpid()), thread_cpu_s(grpc_side.server_pid))
        load1, busy1, wall1 = loadavg(), bc.machine_busy_s(), time.perf_counter()
        op1, srv1 = inproc.op_stats(), grpc_side.server_stats()
        micro = micro_breakdown(inproc, grpc_side, args.micro_repeats)
        req_bytes, resp_bytes = grpc_side.last_request.ByteSize(), grpc_side.last_response.ByteSize()
    finally:
        inproc.release()
        grpc_side.release()

    n = cfg.num_steps
    i_calls, g_calls = inproc.clock.times, grpc_side.clock.times
    # This process's threads also run the gRPC client (little CPU); the server's only serve the gRPC side.
    bench_cpu, bench_busy = busy_threads(threads0[0], threads1[0], sum(i_calls))
    srv_cpu, srv_busy = busy_threads(threads0[1], threads1[1], sum(g_calls))
    # Cores that other processes kept busy meanwhile (the machine's busy time minus both sides' CPU time).
    # /proc counts 10 ms ticks: in windows under a second or two that is too coarse to flag anything.
    others = None if busy0 is None or busy1 is None or wall1 - wall0 < 2.0 else \
        max(0.0, (busy1 - busy0 - bench_cpu - srv_cpu) / (wall1 - wall0))
    i_call, g_call = statistics.median(i_calls), statistics.median(g_calls)
    agree = sum(a == b for a, b in zip(inproc.history, grpc_side.history)) / len(inproc.history)
    mean_ms = lambda xs: 1e3 * statistics.fmean(xs)  # noqa: E731
    inproc_op = mean_between(op0, op1)
    srv_op, srv_rpc = mean_between(srv0["op"], srv1["op"]), mean_between(srv0["rpc"], srv1["rpc"])
    g_mean, i_mean = mean_ms(g_calls), mean_ms(i_calls)
    breakdown = {  # means over the timed calls, ms per call
        "inproc_call": i_mean, "grpc_call": g_mean, "overhead": g_mean - i_mean,
        "inproc_op": inproc_op, "server_op": srv_op, "server_rpc": srv_rpc,
        "op_diff": None if srv_op is None or inproc_op is None else srv_op - inproc_op,
        "servicer": None if srv_rpc is None or srv_op is None else srv_rpc - srv_op,
        "transport": None if srv_rpc is None else mean_ms(grpc_side.parts["call"]) - srv_rpc,
        "grpc_client": mean_ms(grpc_side.parts["build"]) + mean_ms(grpc_side.parts["read"]),
        "inproc_client": mean_ms(inproc.parts["build"]) + mean_ms(inproc.parts["read"]),
        "grpc_build": mean_ms(grpc_side.parts["build"]), "grpc_read": mean_ms(grpc_side.parts["read"]),
        "grpc_stub_call": mean_ms(grpc_side.parts["call"]),
        "inproc_build": mean_ms(inproc.parts["build"]), "inproc_read": mean_ms(inproc.parts["read"]),
        "inproc_decode_call": mean_ms(inproc.parts["call"]),
    }
    return {
        "config": cfg.name, "mode": cfg.mode.value, "logits_dtype": pb.LogitsDtype.Name(cfg.logits_dtype)
        if not cfg.wants_tokens else None, "num_steps": n, "batch": batch, "context": args.context,
        "inproc_ms": 1e3 * i_call / n, "grpc_ms": 1e3 * g_call / n, "grpc_over_inproc": g_call / i_call,
        "grpc_over_inproc_min": min(g_calls) / min(i_calls),
        "inproc_call_ms": 1e3 * i_call, "grpc_call_ms": 1e3 * g_call,
        "inproc_tok_s": batch * n / i_call, "grpc_tok_s": batch * n / g_call,
        "request_bytes": req_bytes, "response_bytes": resp_bytes,
        "inproc_cpu_ms": 1e3 * statistics.median(inproc.clock.cpu_times),
        "grpc_client_cpu_ms": 1e3 * statistics.median(grpc_side.clock.cpu_times),
        "server_cpu_ms": 1e3 * srv_cpu / len(g_calls), "server_busy_threads": srv_busy,
        # CPU per wall second while each side ran: ~T when a side had its T cores, less when others competed.
        "inproc_cores": statistics.fmean(inproc.clock.cpu_times) / statistics.fmean(i_calls),
        "server_cores": srv_cpu / sum(g_calls),
        "inproc_busy_threads": bench_busy, "loadavg_1m": [load0, load1], "other_processes_cores": others,
        "tokens_agree": agree, "prefill_tokens_agree": first_agree,
        "breakdown_ms": breakdown, "micro_ms": micro,
        "inproc_times": stats(i_calls), "grpc_times": stats(g_calls),
    }


COLUMNS = [("config", "config"), ("batch", "batch"), ("inproc_ms", "inproc ms/step"), ("grpc_ms", "grpc ms/step"),
           ("grpc_over_inproc", "grpc/inproc", 3), ("grpc_over_inproc_min", "min ratio", 3),
           ("response_bytes", "resp bytes"),
           ("inproc_tok_s", "inproc tok/s", 1), ("grpc_tok_s", "grpc tok/s", 1),
           ("grpc_multi_over_single", "grpc xN/x1", 3), ("inproc_multi_over_single", "inproc xN/x1", 3),
           ("multi_gain_grpc_vs_inproc", "g/i", 3)]
BREAKDOWN_COLUMNS = [("config", "config"), ("batch", "batch"), ("overhead", "grpc-inproc ms"),
                     ("op_diff", "op diff"), ("servicer", "servicer"), ("transport", "transport"),
                     ("client_diff", "client diff"), ("micro_serde", "serde (micro)"),
                     ("micro_codec", "codec (micro)"), ("inproc_op", "inproc op"), ("server_op", "srv op"),
                     ("inproc_cpu", "inproc cpu"), ("server_cpu", "srv cpu"), ("inproc_cores", "inproc cores"),
                     ("server_cores", "srv cores"), ("inproc_threads", "inproc thr"), ("server_threads", "srv thr")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.omp_wait_policy and args.omp_wait_policy != _POLICY_ARG:
        log(f"warning: --omp-wait-policy {args.omp_wait_policy} only acts when the script is run as a program "
            f"(torch is imported by then); OMP_WAIT_POLICY is {os.environ.get('OMP_WAIT_POLICY') or 'unset'}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally/atexit cleanup on SIGTERM too
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    threads = max(1, threads)
    torch.set_num_threads(threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    model_dir = Path(args.model) if args.model else bc.default_model_dir()
    max_steps = max(c.num_steps for c in args.config_list)
    per_seq_tokens = args.context + 1 + (args.warmup + args.steps) * max_steps
    kv_blocks = max(args.batch_list) * -(-per_seq_tokens // DEFAULT_BLOCK_SIZE) + 16  # + slack
    max_batch_tokens = max(args.max_batch_tokens, args.context)
    log(f"model {model_dir}, device {device}, dtype {args.dtype}, {threads} threads per side, "
        f"KV {kv_blocks} blocks per side")

    cmd = [sys.executable, "-m", "executor_service", "--model", str(model_dir), "--port", "0",
           "--kv-blocks", str(kv_blocks), "--threads", str(threads), "--device", args.device, "--dtype", args.dtype,
           "--max-batch-tokens", str(max_batch_tokens), "--max-message-mb", str(MAX_MESSAGE_MB),
           "--log-level", "WARNING"]
    t0 = time.perf_counter()
    server = ServerProcess(cmd)  # loads while this process loads its own copy
    channel = None
    try:
        ex = Executor(ExecutorConfig(model_dir, device=args.device, dtype=args.dtype, kv_blocks=kv_blocks,
                                     max_batch_tokens=max_batch_tokens, progress=False))
        warm = ex.prefill([ex.info().bos_token_id or 0] * 4)  # as the server does before READY
        ex.release_cache([warm.cache.cache_id])
        address = server.wait_ready(args.server_timeout)
        limit = MAX_MESSAGE_MB * 1024 * 1024
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", limit),
                                                          ("grpc.max_send_message_length", limit)])
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.ExecutorServiceStub(channel)
        info = stub.GetInfo(pb.GetInfoRequest())
        log(f"server {address} (pid {server.proc.pid}) and in-process executor ready in "
            f"{time.perf_counter() - t0:.1f}s")
        inproc, grpc_side = InProcSide(ex), GrpcSide(stub, max_batch_tokens, device, server.proc.pid)
        vocab, max_len = ex.model_config.vocab_size, ex.model_config.max_position_embeddings
        if per_seq_tokens > max_len:
            raise SystemExit(f"error: --context {args.context} + 1 + (--warmup {args.warmup} + --steps {args.steps}) x "
                             f"{max_steps} steps per call = {per_seq_tokens} tokens per sequence; the model takes at "
                             f"most {max_len}")

        empty_before = empty_rpc_ms(stub, args.empty_rpcs)
        interceptor_ms = interceptor_overhead_ms()
        log(f"empty RPC round trip {empty_before['median_ms']:.3f} ms; interceptor wrapper {interceptor_ms * 1e3:.2f} us")
        rows: list[dict[str, Any]] = []
        for b in args.batch_list:
            for cfg in args.config_list:
                t1 = time.perf_counter()
                r = bench_config(inproc, grpc_side, cfg, b, vocab, args, device)
                rows.append(r)
                log(f"{cfg.name} batch {b}: inproc {r['inproc_ms']:.2f} ms/step, grpc {r['grpc_ms']:.2f} ms/step, "
                    f"grpc/inproc {r['grpc_over_inproc']:.3f} ({time.perf_counter() - t1:.1f}s)")
        empty_after = empty_rpc_ms(stub, args.empty_rpcs)
        server_info = {"address": address, "pid": server.proc.pid, "command": cmd, "model_id": info.model_id,
                       "dtype": info.dtype, "device": info.device, "kv_total_blocks": info.kv.total_blocks}
    finally:
        if channel is not None:
            channel.close()
        code = server.stop()
    log(f"server stopped (exit code {code})")

    single = {(r["batch"]): r for r in rows if r["config"] == "tokens"}
    for r in rows:
        one = single.get(r["batch"])
        if r["num_steps"] > 1 and r["mode"] == "tokens" and one:
            r["grpc_multi_over_single"] = r["grpc_ms"] / one["grpc_ms"]
            r["inproc_multi_over_single"] = r["inproc_ms"] / one["inproc_ms"]
            r["multi_gain_grpc_vs_inproc"] = r["grpc_multi_over_single"] / r["inproc_multi_over_single"]
        bd, micro = r["breakdown_ms"], r["micro_ms"]
        bd["client_diff"] = bd["grpc_client"] - bd["inproc_client"]
        bd["micro_serde"] = micro["req_serialize"] + micro["req_parse"] + micro["resp_serialize"] + micro["resp_parse"]
        bd["micro_codec"] = micro["codec_in"] + micro["codec_out"]
        bd["inproc_cpu"], bd["server_cpu"] = r["inproc_cpu_ms"], r["server_cpu_ms"]
        bd["inproc_threads"], bd["server_threads"] = r["inproc_busy_threads"], r["server_busy_threads"]
        bd["inproc_cores"], bd["server_cores"] = r["inproc_cores"], r["server_cores"]

    cfg = ex.model_config
    print(f"model: {model_dir.name}  ({cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size})")
    print(f"device: {device}  dtype: {args.dtype}  threads per side: {threads}  "
          f"OMP_WAIT_POLICY: {os.environ.get('OMP_WAIT_POLICY') or 'unset'}  context {args.context}, "
          f"{args.steps} timed calls after {args.warmup} per side and configuration; medians")
    print(f"empty RPC round trip: {empty_before['median_ms']:.3f} ms before, {empty_after['median_ms']:.3f} ms after; "
          f"interceptor wrapper: {interceptor_ms * 1e3:.2f} us per call\n")
    print(bc.format_table(rows, COLUMNS))
    print("\ngrpc/inproc: median call time over gRPC / in-process (request building and response reading "
          "included on both sides); min ratio: of the fastest calls.\nxN/x1: per-token time of the multi-step "
          "call / the tokens row's (longer contexts included); g/i: grpc xN/x1 / inproc xN/x1.")
    print("\nwhere the gRPC time goes (ms per call, means): op diff = server executor - in-process executor; "
          "servicer = handler - executor (codec);\ntransport = stub call - handler (serde + channel); "
          "client diff = gRPC client build+read - in-process build+read; micro: pieces timed alone here.\n")
    print(bc.format_table([{**r["breakdown_ms"], "config": r["config"], "batch": r["batch"]} for r in rows],
                          BREAKDOWN_COLUMNS))
    busy = [f"{r['config']}@{r['batch']} ({r['other_processes_cores']:.2f})" for r in rows
            if (r["other_processes_cores"] or 0) > 0.25]
    if busy:
        print(f"\nnote: other processes kept > 0.25 cores busy (mean cores in brackets) while timing {', '.join(busy)}; "
              "those ratios are not the idle-machine ones")
    disagree = [f"{r['config']}@{r['batch']}" for r in rows if (r["tokens_agree"] < 1 or not r["prefill_tokens_agree"])
                and r["logits_dtype"] != "LOGITS_DTYPE_BFLOAT16"]  # bf16-rounded logits: other argmax ties, expected
    if disagree:
        print(f"\nnote: the two sides fed back different tokens in {', '.join(disagree)} (numerics differ)")

    payload = {
        "benchmark": "bench_executor",
        "model": {"dir": str(model_dir), "name": model_dir.name, "architecture": cfg.architecture,
                  "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        "machine": bc.machine_info(device),
        "settings": {"batches": args.batch_list, "configs": [c.name for c in args.config_list],
                     "context": args.context, "steps": args.steps, "warmup": args.warmup,
                     "multi_steps": args.multi_steps, "threads_per_side": threads, "dtype": args.dtype,
                     "seed": args.seed, "kv_blocks": kv_blocks, "max_batch_tokens": max_batch_tokens,
                     "max_message_mb": MAX_MESSAGE_MB, "quick": args.quick,
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (libgomp default)",
                     "timed_region": "request/items building + decode call + reading tokens (logits: "
                                     "decode_logits to float32) on both sides"},
        "server": server_info,
        "empty_rpc": {"before": empty_before, "after": empty_after},
        "interceptor_overhead_ms": interceptor_ms,
        "rows": rows,
    }
    path = bc.write_json(args.out, payload)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
