"""Small drivers over the in-process Executor used by several parity tests."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.types import (CacheRef, CreateCacheItem, DecodeItem, DecodeResult, OutputMode, OutputOptions,
                                    SequenceOutput, UnifiedItem, UnifiedResult)
from tests.device_tolerances import greedy_agreement
from tests.devices import CPU, Device

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)


def raising(results: list[UnifiedResult] | list[DecodeResult]) -> list:
    """The results of a batch call, or the first failed item's error raised: a per-item failure seen as the
    single-item call would raise it (for tests of one item's error)."""
    for r in results:
        if r.error is not None:
            raise r.error
    return results


def make_executor(model_dir: Path, kv_blocks: int = 256, prefix_caching: bool = True, device: Device = CPU,
                  **kwargs) -> Executor:
    """prefix_caching=False: the executor of --no-prefix-caching (nothing hashed, CreateCache reuses nothing).
    device: where it runs and in which dtype (tests/devices.py; a `dtype` keyword overrides the dtype)."""
    kwargs.setdefault("dtype", device.dtype_name)
    if device.name == "cuda":  # graphs as served, but four buckets (1, 2, 4, 8: the tests' batches) to capture
        kwargs.setdefault("cuda_graph_max_batch", 8)
    return Executor(ExecutorConfig(Path(model_dir), device=device.name, kv_blocks=kv_blocks, progress=False,
                                   prefix_caching=prefix_caching, **kwargs))


def create_cache(ex: Executor, prompt: Sequence[int], adapter: str = "", salt: str = "") -> tuple[str, int]:
    """create_caches for one prompt: (cache id, tokens reused from the prefix cache); raises the item's error."""
    (res,) = raising(ex.create_caches([CreateCacheItem(tuple(prompt), adapter, salt)]))
    assert res.cache.seq_len == res.cached_tokens
    return res.cache.cache_id, res.cached_tokens


def warm_prefixes(ex: Executor, prompts: Sequence[Sequence[int]], adapters: Sequence[str] = ()) -> None:
    """Computes the prompts in one forward and releases their caches: their full blocks stay cached, so a
    later create_caches of the same prompts reuses them (prefix caching)."""
    adapter = list(adapters) or [""] * len(prompts)
    results = raising(ex.unified_decode([UnifiedItem(tuple(p), adapter=a) for p, a in zip(prompts, adapter)]))
    ex.release_cache([r.cache.cache_id for r in results])


def prefill_prompt(ex: Executor, prompt: list[int], chunk: int | None = None, adapter: str = "",
                   create: bool = False, salt: str = "") -> tuple[str, int, SequenceOutput]:
    """Writes a prompt: whole (prefill) or as chunks through unified_decode; with create, first through
    create_caches (only the part past the reused prefix is then computed). Returns (cache id, tokens reused,
    the output after the prompt, with logits)."""
    cache_id, pos = create_cache(ex, prompt, adapter, salt) if create else (None, 0)
    cached = pos
    if chunk is None:
        res = ex.prefill(prompt[pos:], cache_id, output=LOGITS, adapter=adapter)
        assert res.cached_tokens == cached
        return res.cache.cache_id, cached, res.output
    while pos < len(prompt):
        part = prompt[pos:pos + chunk]
        final = pos + len(part) == len(prompt)
        (res,) = raising(ex.unified_decode([UnifiedItem(tuple(part), cache_id, pos, final, output=LOGITS,
                                                        adapter=adapter)]))
        assert (res.output is not None) == final
        cache_id, pos, out = res.cache.cache_id, pos + len(part), res.output
    return cache_id, cached, out


def greedy_run(ex: Executor, prompt: list[int], steps: int, chunk: int | None = None, adapter: str = "",
               create: bool = False) -> tuple[str, list[int], list[torch.Tensor]]:
    """Prefill (whole, or as chunks through unified_decode; with create, through create_caches first) then
    greedy decode one step at a time, all with `adapter` (empty = the base model). Returns (cache id,
    tokens, logits before each token)."""
    cache_id, _, out = prefill_prompt(ex, prompt, chunk, adapter, create)
    tokens = [out.tokens[0].token_id]
    logits = [out.logits[0]]
    for _ in range(steps - 1):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + len(tokens) - 1), tokens[-1], output=LOGITS,
                                     adapter=adapter)])
        tokens.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
    return cache_id, tokens, logits


def teacher_forced_logits(ex: Executor, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Logits before each of `tokens` when exactly these tokens follow `prompt` (cache released after)."""
    first = ex.prefill(prompt, output=LOGITS)
    out, cache_id = [first.output.logits[0]], first.cache.cache_id
    for i, token in enumerate(tokens[:-1]):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + i), token, output=LOGITS)])
        out.append(d.output.logits[0])
    ex.release_cache([cache_id])
    return out


def mixed_batch_run(ex: Executor, prompts: list[list[int]], steps: int, release_after: dict[int, int] | None = None,
                    chunk: int = 8, adapters: Sequence[str] = (), release: bool = True,
                    on_step: Callable[[list[UnifiedItem], list[UnifiedResult]], None] | None = None,
                    create: Sequence[int] = ()) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Runs every sequence through shared unified_decode calls: prompt chunks of `chunk` tokens beside
    single-token decodes, greedy, sequence i with adapters[i] (default: the base model); sequence i is released
    after release_after.get(i, steps) tokens (kept, with release=False). The sequences listed in `create` start
    from one create_caches call (their prompts' cached prefixes reused; the others start as new caches in
    the first call). on_step sees each call's items and results. Returns per sequence (tokens, logits before
    each token)."""
    n = len(prompts)
    release_after = release_after or {}
    adapter = list(adapters) or [""] * n
    cache: list[str | None] = [None] * n
    fed = [0] * n  # prompt tokens written so far
    if create:
        made = raising(ex.create_caches([CreateCacheItem(tuple(prompts[i]), adapter[i]) for i in create]))
        for i, res in zip(create, made):
            cache[i], fed[i] = res.cache.cache_id, res.cached_tokens
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
                          steps: int, dtype: torch.dtype = torch.float32, chunk: int | None = None,
                          create: bool = False) -> None:
    """greedy_run equals a reference (logits within the dtype's tolerance at every step, identical tokens up to
    a near tie the dtype can flip: tests/device_tolerances.py), the cache holds what was written, and releasing
    it frees the whole pool. With create, the prompt's prefix is cached first (warm_prefixes) and the run reuses
    it through create_caches."""
    if create:
        hits = ex.prefix_stats().hit_tokens
        warm_prefixes(ex, [prompt])
    cache_id, tokens, logits = greedy_run(ex, prompt, steps, chunk=chunk, create=create)
    if create:
        bs = ex.kv_usage().block_size
        assert ex.prefix_stats().hit_tokens - hits == min(len(prompt) // bs * bs, len(prompt) - 1) > 0
    greedy_agreement(tokens, logits, ref_tokens, ref_logits, dtype, "greedy run")
    assert ex.cache_length(cache_id) == len(prompt) + steps - 1
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks
