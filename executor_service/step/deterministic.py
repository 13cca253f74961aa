"""`--deterministic`: the executor's calls computed so that a request's tokens and logprobs are the same bits
whatever it was batched with, however its prompt was chunked, and whether it was preempted and recomputed,
restarted or moved to another executor of the same build (docs/deterministic.md).

Two parts, each row-invariant on its own:
- the forward: every row of every call (prompt chunks, decode steps, drafts, ForwardVerify) through the native
  step (models/decode/deterministic.py), never the eager PyTorch forward, whose matrix kernels reduce in an
  order chosen by the number of rows;
- the sampler: each row sampled alone on one thread (models/sampler.py, invariant=True); its draws were
  already keyed by (seed, position) only.

What cannot be made invariant here is refused at start by executor_service/step/decode_choice.py (ValueError,
the CLI exits 2): LoRA adapters (their deltas run in the eager forward), --compile and --decode-kernel torch
(eager steps), --tensor-parallel-size > 1, and whatever the native step itself refuses (a GPU, MoE layers,
float16 models, the families ModelConfig.native_decode_refusal names, a CPU without AVX2/FMA/F16C or no compiler).

Prompt logprobs: the native step gives the logits of every row, so the runner scores prompt tokens from those
logits directly (the "hidden state" a cache keeps between chunks is then its last row's logits).
"""
from __future__ import annotations

from typing import Callable

import torch

from executor_service.step.batch import BatchRunner, PlannedItem
from executor_service.prompt_logprobs import LogprobRows, score
from models.decode.deterministic import RowInvariantStep
from models.kv.paged_cache import PagedKvCache
from models.lora.weights import LoraWeights
from models.sampler import Sampler
from models.transformer import DecoderModel


class DeterministicRunner(BatchRunner):
    """BatchRunner whose forward runs every token as a row of the row-invariant step and whose sampler samples
    each row alone."""

    def __init__(self, model: DecoderModel, kv: PagedKvCache, step: RowInvariantStep) -> None:
        super().__init__(model, kv, None, step)
        self.step = step
        self.sampler = Sampler(model.config.vocab_size, invariant=True)

    @torch.inference_mode()
    def _forward(self, batch: list[PlannedItem], all_positions: bool,
                 adapters: dict[str, LoraWeights]) -> tuple[torch.Tensor, list[int], list[torch.Tensor | None]]:
        """As BatchRunner._forward: the logits of the rows to sample, rows per item, and per item asking for
        prompt logprobs the logits of all its rows (what _score reads here instead of hidden states)."""
        if adapters:  # (refused at start: no adapter can be loaded)
            raise ValueError("--deterministic serves no LoRA adapters")
        ids: list[int] = []
        tables: list[list[int]] = []
        pasts: list[int] = []
        keep: list[int] = []  # rows whose logits are wanted: sampled ones, and every row of a scoring item
        sampled: list[int] = []
        spans: list[tuple[int, int] | None] = []
        rows_per_item: list[int] = []
        for b in batch:
            tokens = (*b.item.token_ids, *b.item.draft_token_ids)
            start, n, drafts = len(ids), len(tokens), len(b.item.draft_token_ids)
            ids.extend(tokens)
            tables.extend([b.state.table.blocks] * n)
            pasts.extend(range(b.state.table.length, b.state.table.length + n))
            spans.append((start, start + n) if b.item.prompt_logprobs is not None else None)
            if not b.item.is_final_chunk:
                rows_per_item.append(0)
            elif all_positions:
                sampled.extend(range(start, start + n))
                rows_per_item.append(n)
            else:  # the last token, and each draft
                sampled.extend(range(start + n - 1 - drafts, start + n))
                rows_per_item.append(1 + drafts)
        keep = sorted(set(sampled).union(*(range(*s) for s in spans if s is not None)))
        logits = self.step.rows(ids, tables, pasts, keep)  # [len(keep), vocab]
        where = {r: i for i, r in enumerate(keep)}
        pick = torch.tensor([where[r] for r in sampled], dtype=torch.int64)
        picked = logits if len(sampled) == len(keep) else logits[pick]
        return picked, rows_per_item, [None if s is None else logits[where[s[0]]:where[s[0]] + s[1] - s[0]]
                                       for s in spans]

    @torch.inference_mode()
    def _score(self, b: PlannedItem, hidden: torch.Tensor | None) -> LogprobRows | None:
        """BatchRunner._score over logits rows (hidden: the item's rows' logits; the cache keeps its last row's)."""
        if hidden is None:
            return None
        pos, tokens = b.item.pos_offset, b.item.token_ids
        rows = hidden[:-1] if not pos else torch.cat([b.state.plp_hidden[None], hidden[:-1]])
        targets = torch.tensor(tokens[1:] if not pos else tokens, dtype=torch.int64)
        return score(_logits, rows, targets, b.item.prompt_logprobs, self.sampler.vocab_size)


_logits: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows  # rows already are float32 logits
