"""Small drivers over the in-process Executor used by several parity tests."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.types import (CacheRef, DecodeItem, DecodeResult, OutputMode, OutputOptions, UnifiedItem,
                                    UnifiedResult)
from tests.hf_reference import rel_err

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)


def raising(results: list[UnifiedResult] | list[DecodeResult]) -> list:
    """The results of a batch call, or the first failed item's error raised: a per-item failure seen as the
    single-item call would raise it (for tests of one item's error)."""
    for r in results:
        if r.error is not None:
            raise r.error
    return results


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


def mixed_batch_run(ex: Executor, prompts: list[list[int]], steps: int, release_after: dict[int, int] | None = None,
                    chunk: int = 8, adapters: Sequence[str] = (), release: bool = True,
                    on_step: Callable[[list[UnifiedItem], list[UnifiedResult]], None] | None = None,
                    ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Runs every sequence through shared unified_decode calls: prompt chunks of `chunk` tokens beside
    single-token decodes, greedy, sequence i with adapters[i] (default: the base model); sequence i is released
    after release_after.get(i, steps) tokens (kept, with release=False). on_step sees each call's items and
    results. Returns per sequence (tokens, logits before each token)."""
    n = len(prompts)
    release_after = release_after or {}
    adapter = list(adapters) or [""] * n
    cache: list[str | None] = [None] * n
    fed = [0] * n  # prompt tokens written so far
    gen: list[list[int]] = [[] for _ in range(n)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    active = set(range(n))
    for _ in range(200 + steps):
        if not active:
            break
        order = sorted(active)
        items = []
        for i in order:
            if fed[i] < len(prompts[i]):
                part = prompts[i][fed[i]:fed[i] + chunk]
                items.append(UnifiedItem(tuple(part), cache[i], fed[i], fed[i] + len(part) == len(prompts[i]),
                                         output=LOGITS, adapter=adapter[i]))
            else:
                pos = len(prompts[i]) + len(gen[i]) - 1
                items.append(UnifiedItem((gen[i][-1],), cache[i], pos, True, output=LOGITS, adapter=adapter[i]))
        results = ex.unified_decode(items)
        if on_step is not None:
            on_step(items, results)
        for i, item, res in zip(order, items, results):
            cache[i] = res.cache.cache_id
            if fed[i] < len(prompts[i]):
                fed[i] += len(item.token_ids)
            if res.output is not None:
                gen[i].append(res.output.tokens[0].token_id)
                logits[i].append(res.output.logits[0])
            if len(gen[i]) == release_after.get(i, steps):
                if release:
                    ex.release_cache([cache[i]])
                active.discard(i)
    return gen, logits


def assert_greedy_matches(ex: Executor, prompt: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor],
                          steps: int, tol: float, chunk: int | None = None) -> None:
    """greedy_run equals a reference (logits within tol relative at every step, identical tokens), the cache
    holds what was written, and releasing it frees the whole pool."""
    cache_id, tokens, logits = greedy_run(ex, prompt, steps, chunk=chunk)
    errors = [rel_err(o, r) for o, r in zip(logits, ref_logits)]
    assert max(errors) < tol, f"worst step {errors.index(max(errors))}: {max(errors):.2e}"
    assert tokens == ref_tokens
    assert ex.cache_length(cache_id) == len(prompt) + steps - 1
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks
