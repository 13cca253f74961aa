"""Many LoRA adapters inside one packed forward.

Every linear layer first runs its base projection once over all tokens; then the adapters' low-rank
updates are added, each to its own tokens only. Two ways, chosen per forward by the token count:
- stacked (decode-sized batches, T <= STACKED_MAX_TOKENS): the adapters' A matrices of a layer are stacked
  along the rank axis ([sum r, in]) and their B side by side ([out, sum r]); one matmul gives every token's
  projection onto every adapter's rank space, a mask keeps each token's own columns, one more matmul
  adds the update — two matmuls per layer whatever the number of adapters (Punica's BGMV idea, with the
  gather replaced by the mask; the wasted columns cost little at small T);
- segmented (prefill-sized batches): per adapter, gather its tokens' rows, two skinny matmuls, scatter-add
  (Punica's SGMV idea), so large prompts do no work for other adapters' columns.
Never a forward per adapter or per item. Ranks may differ between adapters.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from models.lora.weights import LoraWeights

STACKED_MAX_TOKENS = 256  # above this, the masked columns' waste outweighs the saved small ops


class LoraStacks:
    """Stacked A/B per (adapter set, layer, slot), kept across forwards: decode steps reuse the same adapter
    set step after step. Only the MAX_SETS most recent sets are kept (each holds a copy of its adapters'
    weights). Cleared when adapters are unloaded or moved (clear())."""

    MAX_SETS = 4

    def __init__(self) -> None:
        self._sets: OrderedDict[tuple[str, ...], dict] = OrderedDict()

    def clear(self) -> None:
        self._sets.clear()

    def get(self, names: tuple[str, ...], weights: list[LoraWeights], layer: int, slot: str
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
        """(A [sum r, in], B [out, sum r], owner of each column as an index into names) or None."""
        stacks = self._sets.get(names)
        if stacks is None:
            stacks = self._sets[names] = {}
            while len(self._sets) > self.MAX_SETS:
                self._sets.popitem(last=False)
        self._sets.move_to_end(names)
        key = (layer, slot)
        if key not in stacks:
            a_parts, b_parts, owners = [], [], []
            for i, w in enumerate(weights):
                ab = w.pairs.get(key)
                if ab is not None:
                    a_parts.append(ab[0])
                    b_parts.append(ab[1])
                    owners.extend([i] * ab[0].shape[0])
            stacks[key] = (torch.cat(a_parts), torch.cat(b_parts, dim=1), tuple(owners)) if a_parts else None
        return stacks[key]


class LoraBatch:
    def __init__(self, names: tuple[str, ...], weights: list[LoraWeights], spans: list[list[tuple[int, int]]],
                 num_tokens: int, device: torch.device, stacks: LoraStacks) -> None:
        self.names, self.weights, self.device, self.stacks = names, weights, device, stacks
        self.stacked = num_tokens <= STACKED_MAX_TOKENS
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        if self.stacked:
            owner = torch.full((num_tokens,), -1, dtype=torch.int64)  # adapter index of each token, -1 = base
            for i, ranges in enumerate(spans):
                for a, b in ranges:
                    owner[a:b] = i
            self._owner = owner.to(device)
        else:
            self._rows = [self._rows_of(sorted(r), device) for r in spans]

    @classmethod
    def build(cls, spans: dict[str, list[tuple[int, int]]], weights: dict[str, LoraWeights], num_tokens: int,
              device: torch.device, stacks: LoraStacks) -> "LoraBatch | None":
        """spans: adapter name -> [(start, stop)) token ranges in the packed batch (base tokens absent)."""
        if not spans:
            return None
        names = tuple(sorted(spans))
        return cls(names, [weights[n] for n in names], [spans[n] for n in names], num_tokens, device, stacks)

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, slot: str) -> torch.Tensor:
        """Adds each token's adapter update to y in place and returns it. y: [T, out]; x: [T, in]."""
        if self.stacked:
            stack = self.stacks.get(self.names, self.weights, layer, slot)
            if stack is not None:
                a, b, owners = stack
                xa = x @ a.T  # [T, sum r]: every token projected onto every adapter's rank space
                # keep each token's own adapter's columns; masked_fill, not a 0/1 product: inf * 0 would be NaN
                y.addmm_(xa.masked_fill_(self._mask(owners), 0.0), b.T)
            return y
        for w, rows in zip(self.weights, self._rows):
            ab = w.pairs.get((layer, slot))
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.T) @ b.T  # [n, in] @ [in, r] @ [r, out]
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y

    def _mask(self, owners: tuple[int, ...]) -> torch.Tensor:
        mask = self._masks.get(owners)
        if mask is None:  # [T, sum r] bool: True where the column belongs to another adapter than the token's
            cols = torch.tensor(owners, dtype=torch.int64, device=self.device)
            mask = self._masks[owners] = self._owner[:, None] != cols[None, :]
        return mask

    @staticmethod
    def _rows_of(ranges: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
        if all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:])):
            return slice(ranges[0][0], ranges[-1][1])  # contiguous: a view, no gather
        return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)
