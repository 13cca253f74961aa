"""Small drivers over the in-process Executor used by several parity tests."""
from __future__ import annotations

from pathlib import Path

import torch

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)


def make_executor(model_dir: Path, kv_blocks: int = 256, **kwargs) -> Executor:
    return Executor(ExecutorConfig(Path(model_dir), device="cpu", kv_blocks=kv_blocks, progress=False, **kwargs))


def greedy_run(ex: Executor, prompt: list[int], steps: int, chunk: int | None = None, adapter: str = ""
               ) -> tuple[str, list[int], list[torch.Tensor]]:
    """Prefill (whole, or as chunks through unified_decode) then greedy decode one step at a time, all with
    `adapter` (empty = the base model). Returns (cache id, tokens, logits before each token)."""
    if chunk is None:
        res = ex.prefill(prompt, output=LOGITS, adapter=adapter)
        cache_id, out = res.cache.cache_id, res.output
    else:
        cache_id, pos = None, 0
        while pos < len(prompt):
            part = prompt[pos:pos + chunk]
            final = pos + len(part) == len(prompt)
            (res,) = ex.unified_decode([UnifiedItem(tuple(part), cache_id, pos, final, output=LOGITS,
                                                    adapter=adapter)])
            assert (res.output is not None) == final
            cache_id, pos, out = res.cache.cache_id, pos + len(part), res.output
    tokens = [out.tokens[0].token_id]
    logits = [out.logits[0]]
    for _ in range(steps - 1):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + len(tokens) - 1), tokens[-1], output=LOGITS,
                                     adapter=adapter)])
        tokens.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
    return cache_id, tokens, logits
