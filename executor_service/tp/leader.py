"""Rank 0's side of a tensor-parallel executor: `LeaderModel` stands in for the sharded DecoderModel in the batch
runner (executor_service/step/batch.py) and prefixes each of its calls with the step the workers must run
(executor_service/tp/channel.py); `CopyLog` records the KV pool's copy-on-write block copies, which the next
step carries so that every rank's pool copies the same blocks before it is written."""
from __future__ import annotations

from typing import Any

import torch

from executor_service.tp.channel import ControlChannel, Step
from models.attention.paged import AttentionMetadata
from models.kv.paged_cache import BlockTable, PagedKvCache
from models.lora.batch import LoraBatch
from models.transformer import DecoderModel


class CopyLog:
    """Wraps `kv`'s copy-on-write so that each copy (source, destination) is recorded until `take`n."""

    def __init__(self, kv: PagedKvCache) -> None:
        self._pending: list[tuple[int, int]] = []
        copy = kv._copy_last_block

        def recorded(table: BlockTable) -> None:
            source = table.blocks[-1]
            copy(table)
            self._pending.append((source, table.blocks[-1]))

        kv._copy_last_block = recorded  # type: ignore[method-assign]

    def take(self) -> tuple[tuple[int, int], ...]:
        pending, self._pending = tuple(self._pending), []
        return pending


class LeaderModel:
    """The sharded model as the batch runner calls it (forward, hidden, project), each call run by every rank.
    Anything else (config, lm_head, modules) is the model's own."""

    def __init__(self, model: DecoderModel, channel: ControlChannel, copies: CopyLog) -> None:
        self.model = model
        self.channel = channel
        self.copies = copies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKvCache,
                 logit_rows: torch.Tensor | None, lora: LoraBatch | None = None) -> torch.Tensor:
        with self.channel.op(self._step("forward", input_ids, meta, logit_rows)):
            return self.model(input_ids, meta, cache, logit_rows)

    def hidden(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKvCache,
               rows: torch.Tensor | None, lora: LoraBatch | None = None) -> torch.Tensor:
        with self.channel.op(self._step("hidden", input_ids, meta, rows)):
            return self.model.hidden(input_ids, meta, cache, rows)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        with self.channel.op(Step("project", shape=tuple(h.shape),
                                        dtype=str(h.dtype).removeprefix("torch."))):
            self.channel.broadcast(h)
            return self.model.project(h)

    def _step(self, op: str, input_ids: torch.Tensor, meta: AttentionMetadata,
              rows: torch.Tensor | None) -> Step:
        if not isinstance(meta, AttentionMetadata):
            raise TypeError("tensor-parallel ranks run the eager forward only (AttentionMetadata)")
        return Step(op, tuple(input_ids.tolist()), meta.items,
                    None if rows is None else tuple(rows.tolist()), self.copies.take())
