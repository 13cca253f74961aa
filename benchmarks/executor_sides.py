"""The two sides of the executor benchmark, each holding B decoding sequences and timing one decode call per step
(request building, the call, reading the response: the same client work on both sides): the in-process
Executor and the same model behind gRPC."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.local_executor import DecodeBatch, DecodeState
from benchmarks.measure import Clock
from benchmarks.workloads import token_budget_groups
from executor_service.rpc import codec
from executor_service.executor import Executor
from executor_service.types import OutputMode, OutputOptions
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Config:
    name: str
    mode: OutputMode
    logits_dtype: int  # wire dtype (gRPC side only)
    num_steps: int

    @property
    def wants_tokens(self) -> bool:
        return self.mode is not OutputMode.LOGITS


def make_configs(multi_steps: int) -> dict[str, Config]:
    f32, bf16 = pb.LOGITS_DTYPE_FLOAT32, pb.LOGITS_DTYPE_BFLOAT16
    return {c.name: c for c in (Config("tokens", OutputMode.TOKENS, f32, 1),
                                Config("logits/f32", OutputMode.LOGITS, f32, 1),
                                Config("logits/bf16", OutputMode.LOGITS, bf16, 1),
                                Config(f"tokens/x{multi_steps}", OutputMode.TOKENS, f32, multi_steps))}


class TimedSide:
    """One decode call per step, timed (_build, _call, _read: the subclass's); the sampled tokens fed back
    (logits modes: the argmax, taken outside the timed region). reset_timing starts the timed calls' record."""
    device: torch.device
    clock: Clock
    history: list[list[int]]  # tokens fed back after each timed call (the sides must agree)
    lengths: list[int]
    tokens: list[int]

    def reset_timing(self) -> None:
        self.clock, self.history = Clock(self.device), []

    def step(self, cfg: Config, timed: bool) -> None:
        clock = self.clock if timed else Clock(self.device)
        with clock:
            self.lengths, read = self._read(self._call(self._build(cfg), cfg), cfg)
        self.tokens = read if cfg.wants_tokens else [int(x.argmax()) for x in read]  # torch or numpy
        if timed:
            self.history.append(self.tokens)


class InProcSide(TimedSide, DecodeBatch):
    def __init__(self, ex: Executor) -> None:
        super().__init__(ex)
        self.device = ex.device

    def _build(self, cfg: Config) -> Any:
        return self.decode_items(OutputOptions(cfg.mode))

    def _call(self, request: Any, cfg: Config) -> Any:
        return self.ex.decode(request, cfg.num_steps)

    def _read(self, response: Any, cfg: Config) -> tuple[list[int], list[Any]]:
        out = [r.output.tokens[-1].token_id if cfg.wants_tokens else r.output.logits for r in response]
        return [r.cache.seq_len for r in response], out


class GrpcSide(TimedSide, DecodeState):
    def __init__(self, stub: pb_grpc.ExecutorServiceStub, max_batch_tokens: int, device: torch.device,
                 pid: int) -> None:
        super().__init__()
        self.stub, self.max_batch_tokens, self.device, self.server_pid = stub, max_batch_tokens, device, pid
        self.last_request: Any = None
        self.last_response: Any = None

    def prefill(self, prompts: list[list[int]]) -> None:
        out = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS)
        for group in token_budget_groups(prompts, self.max_batch_tokens):
            items = [pb.UnifiedItem(token_ids=p, is_final_chunk=True, output=out) for p in group]
            self.add(self.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=items)).results)

    def _build(self, cfg: Config) -> Any:
        mode = pb.OUTPUT_MODE_TOKENS if cfg.wants_tokens else pb.OUTPUT_MODE_LOGITS
        out = pb.OutputOptions(mode=mode, logits_dtype=cfg.logits_dtype)
        req = pb.DecodeRequest(num_steps=cfg.num_steps)
        for c, n, t in zip(self.caches, self.lengths, self.tokens):
            req.items.add(cache=pb.CacheRef(cache_id=c, seq_len=n), token_id=t, output=out)
        return req

    def _call(self, request: Any, cfg: Config) -> Any:
        self.last_request, self.last_response = request, self.stub.Decode(request)
        return self.last_response

    def _read(self, response: Any, cfg: Config) -> tuple[list[int], list[Any]]:
        res = response.results
        out = [r.output.tokens[-1].token_id if cfg.wants_tokens else codec.decode_logits(r.output.logits) for r in res]
        return [r.cache.seq_len for r in res], out

    def release(self) -> None:
        if self.caches:
            self.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=self.caches))
        self.clear()

