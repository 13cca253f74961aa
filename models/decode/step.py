"""What every decode-step implementation of this folder offers the batch runner (executor_service/step/batch.py):
one call over rows that each add one token (plus, where `takes_drafts`, an item's drafts at the positions after
it), returning the logits of every row."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch


class DecodeStep(Protocol):
    calls: int  # decode steps it ran
    takes_drafts: bool  # rows of one sequence at consecutive positions in one call (an item's drafts)

    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]],
            pasts: Sequence[int]) -> torch.Tensor: ...  # float32 logits [B, vocab]
