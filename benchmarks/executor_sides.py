"""The two sides of the executor benchmark: the in-process Executor and the same model behind gRPC, each
holding B decoding sequences and timing one decode call per step (request building, the call and reading
the response: the same client work on both sides)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.local_executor import DecodeBatch, DecodeState
from benchmarks.measure import Clock
from benchmarks.workloads import token_budget_groups
from executor_service import codec
from executor_service.executor import Executor
from executor_service.types import DecodeItem, OutputMode, OutputOptions
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc


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


class TimedSide:
    """Mixin of a side: one decode call per step, timed in parts (request building, the call, reading the
    response), and the tokens fed back; reset_timing starts the timed calls' record."""
    name = ""
    device: torch.device
    clock: Clock | None = None
    parts: dict[str, list[float]]
    history: list[list[int]]  # tokens fed back after each timed call (sanity check)
    lengths: list[int]
    tokens: list[int]

    def reset_timing(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self.parts = {"build": [], "call": [], "read": []}
        self.history = []

    def step(self, cfg: Config, timed: bool) -> None:
        """One decode call from the sequences' state; logits modes take the argmax outside the timed region."""
        clock = self.clock if timed else Clock(self.device)
        with clock:
            t0 = time.perf_counter()
            request = self._build(cfg)
            t1 = time.perf_counter()
            response = self._call(request, cfg)
            t2 = time.perf_counter()
            lengths, read = self._read(response, cfg)
            t3 = time.perf_counter()
        sampled = read if cfg.wants_tokens else [self._argmax(x) for x in read]
        self.lengths, self.tokens = lengths, sampled
        if timed:
            self.parts["build"].append(t1 - t0)
            self.parts["call"].append(t2 - t1)
            self.parts["read"].append(t3 - t2)
            self.history.append(sampled)

    def _build(self, cfg: Config) -> Any:
        raise NotImplementedError

    def _call(self, request: Any, cfg: Config) -> Any:
        raise NotImplementedError

    def _read(self, response: Any, cfg: Config) -> tuple[list[int], list[Any]]:
        """(lengths, sampled tokens or, in logits modes, each row's float32 logits)."""
        raise NotImplementedError

    def _argmax(self, logits: Any) -> int:
        raise NotImplementedError


class InProcSide(TimedSide, DecodeBatch):
    name = "inproc"

    def __init__(self, ex: Executor) -> None:
        super().__init__(ex)
        self.device = ex.device
        self.last_results: list[Any] | None = None

    def _build(self, cfg: Config) -> list[DecodeItem]:
        return self.decode_items(OutputOptions(cfg.mode))

    def _call(self, request: list[DecodeItem], cfg: Config) -> list[Any]:
        self.last_results = self.ex.decode(request, cfg.num_steps)
        return self.last_results

    def _read(self, response: list[Any], cfg: Config) -> tuple[list[int], list[Any]]:
        lengths = [r.cache.seq_len for r in response]
        if cfg.wants_tokens:
            return lengths, [r.output.tokens[-1].token_id for r in response]
        return lengths, [r.output.logits for r in response]  # [1, vocab] float32 tensors, as the caller gets them

    def _argmax(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def op_stats(self) -> tuple[int, float]:
        s = self.ex.metrics_snapshot().ops.get("decode")
        return (s.count, s.mean_ms * s.count) if s else (0, 0.0)


class GrpcSide(TimedSide, DecodeState):
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
        for group in token_budget_groups(prompts, self.max_batch_tokens):
            req = pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(token_ids=p, is_final_chunk=True, output=out)
                                                 for p in group])
            self.add(self.stub.UnifiedDecode(req).results)

    def _build(self, cfg: Config) -> pb.DecodeRequest:
        out = pb.OutputOptions(mode=cfg.pb_mode, logits_dtype=cfg.logits_dtype)
        req = pb.DecodeRequest(num_steps=cfg.num_steps)
        for c, n, t in zip(self.caches, self.lengths, self.tokens):
            req.items.add(cache=pb.CacheRef(cache_id=c, seq_len=n), token_id=t, output=out)
        return req

    def _call(self, request: pb.DecodeRequest, cfg: Config) -> pb.DecodeResponse:
        self.last_request, self.last_response = request, self.stub.Decode(request)
        return self.last_response

    def _read(self, response: pb.DecodeResponse, cfg: Config) -> tuple[list[int], list[Any]]:
        results = response.results
        lengths = [r.cache.seq_len for r in results]
        if cfg.wants_tokens:
            return lengths, [r.output.tokens[-1].token_id for r in results]
        return lengths, [codec.decode_logits(r.output.logits) for r in results]  # [1, vocab] float32 arrays

    def _argmax(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits))

    def release(self) -> None:
        if self.caches:
            self.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=self.caches))
        self.clear()

    def server_stats(self) -> dict[str, tuple[int, float]]:
        m = self.stub.GetMetrics(pb.GetMetricsRequest())
        op, rpc = m.operations.get("decode"), m.rpcs.get("Decode")
        return {"op": (op.count, op.mean_ms * op.count) if op else (0, 0.0),
                "rpc": (rpc.count, rpc.mean_ms * rpc.count) if rpc else (0, 0.0)}
