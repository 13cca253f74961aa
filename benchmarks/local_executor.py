"""An in-process Executor for benchmarks, and B sequences decoding together on it (or on an executor server)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from benchmarks.workloads import token_budget_groups
from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem

TOKENS_ONLY = OutputOptions(OutputMode.TOKENS)


def build_executor(model_dir: Path, device: str, dtype: str, kv_blocks: int, max_batch_tokens: int,
                   **options: Any) -> Executor:
    """An Executor on the model, without the loading progress bar; options: other ExecutorConfig fields."""
    return Executor(ExecutorConfig(model_dir, device=device, dtype=dtype, kv_blocks=kv_blocks,
                                   max_batch_tokens=max_batch_tokens, progress=False, **options))


class DecodeState:
    """B sequences decoding together: each one's cache id, length and next token. Reads the Executor's results
    and an executor server's response messages alike (the same field names)."""

    def __init__(self) -> None:
        self.caches: list[str] = []
        self.lengths: list[int] = []
        self.tokens: list[int] = []

    def add(self, results: Iterable[Any]) -> None:
        """Appends the sequences that prefill results started (their sampled token is fed next)."""
        for r in results:
            self.caches.append(r.cache.cache_id)
            self.lengths.append(r.cache.seq_len)
            self.tokens.append(r.output.tokens[0].token_id)

    def advance(self, results: Sequence[Any]) -> None:
        self.lengths = [r.cache.seq_len for r in results]
        self.tokens = [r.output.tokens[-1].token_id for r in results]

    def clear(self) -> None:
        self.caches, self.lengths, self.tokens = [], [], []


class DecodeBatch(DecodeState):
    """DecodeState on an in-process Executor: starts the sequences, builds their decode items, frees them."""

    def __init__(self, ex: Executor) -> None:
        super().__init__()
        self.ex = ex

    def prefill(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str] | None = None) -> None:
        """One cache per prompt (prompt i on adapters[i]; greedy) in unified_decode calls of at most the
        executor's max_batch_tokens tokens."""
        pairs = list(zip(prompts, adapters or [""] * len(prompts)))
        for group in token_budget_groups(pairs, self.ex.config.max_batch_tokens, size=lambda pair: len(pair[0])):
            self.add(self.ex.unified_decode([UnifiedItem(tuple(p), output=TOKENS_ONLY, adapter=a) for p, a in group]))

    def decode_items(self, output: OutputOptions = TOKENS_ONLY, adapters: Sequence[str] | None = None
                     ) -> list[DecodeItem]:
        adapters = adapters or [""] * len(self.caches)
        return [DecodeItem(CacheRef(c, n), t, output=output, adapter=a)
                for c, n, t, a in zip(self.caches, self.lengths, self.tokens, adapters)]

    def release(self) -> None:
        if self.caches:
            self.ex.release_cache(self.caches)
        self.clear()
