"""The token masks of a step's constrained items: computed off the event loop, ahead of need.

One engine's timeline (scheduler/engine/engine.py) while constrained sequences run:

    step n answered -> policy.update: each matcher consumes its sequence's token (Sequence.append)
                    -> prefetch(): the masks for step n+1 start in the mask thread       \\  overlapped
                    -> deltas detokenized and streamed, releases, step n+1 planned, built /
                    -> attach(): waits for what is left, puts the masks on the items -> UnifiedDecode n+1

llguidance fills a batch's masks with the GIL released, in parallel on its own threads (LLExecutor), so the
loop's work for the next step runs meanwhile; only the wait left in attach() adds to the step (MaskStats
counts both, and the scheduler's /metrics exports them). That wait blocks the loop (up to _BLOCK_S, then it
yields): yielding would let every stream's handler write its delta before the step goes out, delaying the
step by more than the masks take (measured: ~6 ms vs ~2 ms per step at batch 32). A mask that was not prefetched (a sequence whose
prompt is final this step: its first mask came with the compiled constraint, so only after a rebuild) is
computed in attach().

One thread computes the masks of every engine of the scheduler (the fleet shares one MaskWorker), so two
engines never use one matcher at once; and a matcher is never advanced while its mask is computed: its next
token comes from a step sent after attach() collected every mask in flight.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import llguidance
import numpy as np

from scheduler.structured.constraint import TokenConstraint
from tandem.token_mask import mask_words

if TYPE_CHECKING:
    from scheduler.engine.planner import StepPlan
    from scheduler.sequence import Sequence
    from tandem.executor.v1 import executor_pb2 as epb


_BLOCK_S = 0.01  # attach() waits this long for masks in flight without yielding to the event loop


@dataclass
class MaskStats:
    masks: int = 0  # masks computed
    compute_s: float = 0.0  # time the mask thread spent computing them
    wait_s: float = 0.0  # time the event loop waited for masks before sending a step (what steps paid)


class MaskWorker:
    """The scheduler's mask thread: fills packed masks (tandem/token_mask.py's layout) for a batch of
    matchers."""

    def __init__(self, vocab_size: int) -> None:
        self.words = mask_words(vocab_size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="token-masks")
        self._parallel: llguidance.LLExecutor | None = None  # its threads start on first use

    def run(self, matchers: list[llguidance.LLMatcher]) -> "Future[tuple[list[bytes], float]]":
        """The masks of the matchers' next tokens, and the seconds the thread took, computed in the thread."""
        return self._pool.submit(self._compute, matchers)

    def _compute(self, matchers: list[llguidance.LLMatcher]) -> tuple[list[bytes], float]:
        start = time.perf_counter()
        out = np.zeros((len(matchers), self.words), dtype="<i4")  # [B, W], rows written by llguidance
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        else:
            if self._parallel is None:
                self._parallel = llguidance.LLExecutor()
            self._parallel.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.ctypes.data,
                                                   out.shape[1] * 4, len(matchers))
        return [row.tobytes() for row in out], time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StepMasks:
    """One engine's masks: prefetch() after a step's tokens are consumed, attach() before the next is sent."""

    def __init__(self, worker: MaskWorker) -> None:
        self.worker = worker
        self.stats = MaskStats()
        self._pending: Future | None = None
        self._pending_for: list[tuple[TokenConstraint, int]] = []  # (constraint, tokens consumed) per mask

    def prefetch(self, running: Iterable["Sequence"]) -> None:
        """Starts computing the next masks of the running constrained sequences (those still without one)."""
        if self._pending is not None:
            return  # (attach() computes what this would have)
        todo = []
        for seq in running:
            c = seq.constraint
            if c is not None and c.active and not seq.finished and seq.is_decoding:
                c.sync(seq.output_ids)
                if c.mask is None and not c.error:
                    todo.append(c)
        if todo:
            self._pending_for = [(c, c.consumed) for c in todo]
            self._pending = self.worker.run([c.matcher for c in todo])

    async def attach(self, plan: "StepPlan", items: list["epb.UnifiedItem"]) -> None:
        """Sets allowed_tokens on the step's final items of constrained sequences (items: plan.items as sent)."""
        wanted = [(msg, item.seq) for msg, item in zip(items, plan.items)
                  if item.is_final and item.seq.constraint is not None and item.seq.constraint.active]
        if not wanted:
            return
        start = time.perf_counter()
        await self._collect()
        missing = []
        for _, seq in wanted:
            seq.constraint.sync(seq.output_ids)
            if seq.constraint.mask is None:
                missing.append(seq.constraint)
        if missing:
            self._pending_for = [(c, c.consumed) for c in missing]
            self._pending = self.worker.run([c.matcher for c in missing])
            await self._collect()
        self.stats.wait_s += time.perf_counter() - start
        for msg, seq in wanted:
            if seq.constraint.mask is not None:  # (None only for a broken matcher: policy.update ends those)
                msg.allowed_tokens = seq.constraint.mask

    async def _collect(self) -> None:
        """Waits for the masks in flight and hands them to their constraints (those still at that token)."""
        if self._pending is None:
            return
        future, targets = self._pending, self._pending_for
        try:
            try:
                # The rest is short (llguidance bounds each mask's work): waiting here, on the loop, sends the
                # step sooner than a trip through the event loop, which would first run every stream's handler
                masks, seconds = future.result(timeout=_BLOCK_S)
            except concurrent.futures.TimeoutError:  # (an unusually slow grammar: let the loop run meanwhile)
                await asyncio.wrap_future(future)
                masks, seconds = future.result()
        finally:
            self._pending, self._pending_for = None, []
        self.stats.masks += len(masks)
        self.stats.compute_s += seconds
        for (c, consumed), mask in zip(targets, masks):
            if c.consumed == consumed and not c.error:
                c.mask = mask
