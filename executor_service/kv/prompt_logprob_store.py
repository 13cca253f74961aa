"""Prompt logprobs kept beside the prefix cache's blocks, by block hash: per indexed block, the prompt
logprobs of its tokens (each scored from the position before it, so the values depend only on the block's
hash chain) with the alternatives computed so far, and the final hidden state of its last position (to score
the token after it, which is not part of the block).

The rule a prompt asking for prompt logprobs with `top` alternatives follows (CreateCacheItem.prompt_logprobs):
it reuses only the leading blocks stored with at least `top` alternatives, and computes the first block
stored without them (or with fewer) and everything after it again. A block computed again replaces the stored
values when it has more alternatives. An entry leaves with its hash (evicted from the index), so the store
never outgrows the index; an entry is a few KiB (hidden_size values plus block_size x (top + 1) numbers),
small beside the block's KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from executor_service.prompt_logprobs import LogprobRows
from executor_service.types import TokenOutput

if TYPE_CHECKING:
    from executor_service.kv.cache_table import CacheState


@dataclass(frozen=True)
class StoredBlock:
    rows: LogprobRows  # its positions with a predecessor: block_size rows (block_size - 1 for a first block)
    hidden: torch.Tensor  # [hidden_size] final hidden state of its last position (on the model's device)


class PromptLogprobStore:
    def __init__(self) -> None:
        self._blocks: dict[bytes, StoredBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: bytes, top: int) -> StoredBlock | None:
        """The block's entry when it holds at least `top` alternatives."""
        entry = self._blocks.get(block_hash)
        return entry if entry is not None and entry.rows.top >= top else None

    def covered(self, hashes: Iterable[bytes], top: int) -> int:
        """How many leading hashes have entries with at least `top` alternatives."""
        n = 0
        for h in hashes:
            if self.get(h, top) is None:
                break
            n += 1
        return n

    def put(self, block_hash: bytes, rows: LogprobRows, hidden: torch.Tensor) -> None:
        """Keeps the block's values unless it holds as many alternatives already."""
        old = self._blocks.get(block_hash)
        if old is None or old.rows.top < rows.top:
            self._blocks[block_hash] = StoredBlock(rows, hidden.detach().clone())

    def forget(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._blocks.pop(h, None)


def restore_prompt_logprobs(state: "CacheState", store: PromptLogprobStore, top: int | None) -> list[TokenOutput]:
    """A cache CreateCache just filled with reused blocks (matched with this `top`): their prompt logprobs,
    cut to `top` alternatives, and the cache's kept hidden state (the last reused position's), so its next
    item's first token can be scored. Nothing when `top` is None or nothing was reused."""
    if top is None or not state.table.hashes:
        return []
    blocks = [store.get(h, top) for h in state.table.hashes]
    state.plp_hidden = blocks[-1].hidden  # (match reused only blocks stored with `top`: none is None)
    return LogprobRows.cat([b.rows for b in blocks], top).outputs(top)
