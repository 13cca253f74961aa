"""The step planner: which sequences take part in the next UnifiedDecode, with how many tokens.

Policy (one step):
1. every running sequence that is decoding gets one token; if their KV growth does not fit the free
   blocks, the reused prefixes held for waiting sequences (CreateCache) are released first — the plan is
   then only that release, and the next one sees what it really freed (blocks shared with running caches
   free nothing) — and otherwise the youngest running sequences are preempted until it does. A plan that
   preempts admits nothing: the victims' blocks are for the running sequences (and the count of what a
   victim frees is an estimate: blocks it shares stay held);
2. running sequences still in their prompt get prefill chunks, oldest first, while the token budget and
   the free blocks last;
3. waiting (new or preempted) sequences are admitted oldest first while fewer than max_running run, the
   budget lasts, the blocks their prompt (plus one token) still needs — beyond a reused prefix they already
   hold (CreateCache, prefix caching; plus the copy of its last block when it ends inside one) — fit the free blocks left after what the running prompts still need — so an admitted prompt never stalls for lack of blocks — and their adapter has a
   slot: the running sequences use at most max_adapters distinct adapters (the executor's
   max_adapters_on_device; the base model takes none; 0 = no limit). Since every running sequence may be in
   any step, this keeps every step within the limit without ever leaving a running sequence out for its
   adapter. The head of the queue is never skipped for a smaller one, or one of an adapter already running,
   behind it (no starvation: once the head waits, nothing new is admitted, so running requests finish and
   free what it waits for). With prefix caching, a waiting sequence whose first blocks a running one is
   still writing waits until they are written, to reuse them (scheduler/engine/prefix_wait.py). Why the head
   waits is the plan's wait_reason.
With speculative decoding (scheduler/engine/speculation.py), decoding sequences may also carry draft tokens, from
the step's token budget and the blocks left after every decode's growth, before any prompt chunk: drafts
never preempt or hold back anything; they only use room the step has.
Chunks end outside the image spans a model writes in one chunk (Gemma 3: scheduler/vision/image_chunks.py): before
the span, or through it past the chunk size; a running prompt whose span does not fit the step keeps the rest of
the budget for the next step.
The executor's own accounting stays the authority: a RESOURCE_EXHAUSTED answer still preempts (engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from scheduler.engine.prefix_wait import awaited_prefix
from scheduler.sequence import Sequence
from scheduler.engine.speculation import Speculator
from scheduler.vision.image_chunks import chunk_tokens
from tandem.ceil_div import ceil_div
from tandem.kv_usage import KvUsage


_NEEDS_BLOCKS = "it needs"
_NOT_LOOKED_UP = "it is not looked up in the executor's prefix cache yet"


@dataclass(frozen=True)
class StepItem:
    seq: Sequence
    start: int  # position of the first token (the sequence's num_cached)
    count: int  # tokens written this step
    drafts: tuple[int, ...] = ()  # speculative decoding: tokens guessed to follow (verified by the executor)
    model_drafts: int = 0  # or: tokens the executor's draft model is to guess (UnifiedItem.model_draft_tokens)

    @property
    def is_final(self) -> bool:  # the chunk reaches the end of the known tokens: sample after it
        return self.start + self.count == self.seq.num_tokens


@dataclass
class StepPlan:
    items: list[StepItem] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # waiting -> running this step
    preempted: list[Sequence] = field(default_factory=list)  # running -> waiting (release their caches)
    unpinned: list[Sequence] = field(default_factory=list)  # waiting, their reused prefixes to release
    wait_reason: str = ""  # why the head of the queue was not admitted ("" = nothing left waiting)
    head_needs_blocks: bool = False  # the head waits for free KV blocks (not for a slot or the budget)

    @property
    def head_needs_lookup(self) -> bool:  # the head waits for the next step's prefix-cache lookup
        return self.wait_reason.startswith(_NOT_LOOKED_UP)


class Planner:
    def __init__(self, max_batch_tokens: int, max_running: int, prefill_chunk: int, max_adapters: int = 0) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.max_adapters = max_adapters  # distinct adapters per step; 0 = no limit
        self.reuse_prefixes = False  # the executor caches prefixes: hold back what a running prefill writes
        self.speculator: Speculator | None = None  # drafts for decoding sequences (the executor verifies them)
        self.skip_drafts_once = False  # the last step was refused for KV with drafts: plan the next without

    def plan(self, running: list[Sequence], waiting: list[Sequence], kv: KvUsage) -> StepPlan:
        """running and waiting are ordered oldest first; neither list is modified."""
        bs = kv.block_size
        plan = StepPlan()
        running = list(running)
        free = kv.free_blocks
        watermark = max(1, kv.total_blocks // 100)  # headroom for decode growth before admitting more

        def grow(seq: Sequence, n: int) -> int:
            return ceil_div(seq.num_cached + n, bs) - ceil_div(seq.num_cached, bs)

        # 1. decodes, preempting the youngest until their growth fits
        while True:
            decoding = [s for s in running if s.is_decoding][:self.max_batch_tokens]
            need = sum(grow(s, 1) for s in decoding)
            if need <= free or not running:
                break
            if not plan.preempted and any(s.cache_id for s in waiting):
                plan.unpinned = [s for s in waiting if s.cache_id]
                return plan
            victim = running.pop()  # youngest
            plan.preempted.append(victim)
            free += ceil_div(victim.num_cached, bs)
        budget = self.max_batch_tokens - len(decoding)
        free -= need
        spec = self.speculator if self.speculator and self.speculator.step_allows_drafts(len(decoding)) else None
        if self.skip_drafts_once:
            spec, self.skip_drafts_once = None, False
        for s in decoding:
            drafts: tuple[int, ...] = ()
            model = 0
            if spec is not None and budget > 0:
                # tokens the blocks it will hold (and the free ones) have room for after its decode token
                room = (ceil_div(s.num_cached + 1, bs) + free) * bs - s.num_cached - 1
                drafts = spec.drafts(s, min(budget, room), len(decoding))
                if not drafts:  # nothing to copy: the executor's draft model guesses, where it runs one
                    model = spec.model_drafts(s, min(budget, room), len(decoding))
                budget -= len(drafts) + model
                free -= grow(s, 1 + len(drafts) + model) - grow(s, 1)
            plan.items.append(StepItem(s, s.num_cached, 1, drafts, model))
        if spec is not None:  # only the drafts that lower the step's time per token (measured costs)
            drafting = [i for i, item in enumerate(plan.items) if item.drafts or item.model_drafts]
            candidates = [(item.seq, len(item.drafts) or item.model_drafts, bool(item.model_drafts))
                          for item in (plan.items[i] for i in drafting)]
            kept = spec.keep(len(decoding), candidates)
            for j, i in enumerate(drafting):
                if j not in kept:
                    plan.items[i] = replace(plan.items[i], drafts=(), model_drafts=0)

        # 2. running prompts (chunked prefill in progress, oldest first)
        prefilling = [s for s in running if not s.is_decoding]
        for s in prefilling:
            n = self._chunk(s, budget, free, bs)
            if n:
                plan.items.append(StepItem(s, s.num_cached, n))
                budget -= n
                free -= grow(s, n)
            elif budget > 0 and any(im.one_chunk for im in s.request.images):  # its image span waits for a
                # step with room for all of it:
                budget = 0  # what is left is not given to younger prompts (no starvation)
        # what running prompts still need after this step: reserved, not available to admissions
        planned = {id(i.seq): i.count for i in plan.items}
        reserved = sum(ceil_div(s.num_tokens + 1, bs) - ceil_div(s.num_cached + planned.get(id(s), 0), bs)
                       for s in prefilling)

        # 3. admissions, oldest first, never skipping the head
        if plan.preempted:
            if waiting:
                plan.wait_reason = "running requests were preempted for KV blocks this step"
            return plan
        n_running = len(running)
        adapters = {s.request.adapter for s in running if s.request.adapter}
        # A waiting sequence may already hold a cache with a reused prefix (CreateCache): its blocks are
        # counted as used by the executor already, so it needs only the blocks for the rest.
        for s in waiting:
            plan.wait_reason = self._wait_reason(s, n_running, budget, free - reserved - watermark, adapters,
                                                 running + plan.admitted, kv)
            if plan.wait_reason:
                plan.head_needs_blocks = plan.wait_reason.startswith(_NEEDS_BLOCKS)
                break
            n = chunk_tokens(s.request.images, s.num_cached, min(s.remaining, self.prefill_chunk, budget),
                             min(s.remaining, budget))
            if not n:
                plan.wait_reason = (f"its first chunk would end inside an image whose tokens are written in one "
                                    f"chunk, and the step has {budget} tokens left")
                break
            plan.admitted.append(s)
            plan.items.append(StepItem(s, s.num_cached, n))
            n_running += 1
            if s.request.adapter:
                adapters.add(s.request.adapter)
            budget -= n
            free -= grow(s, n) + _shared_tail(s, bs)
            reserved += ceil_div(s.num_tokens + 1, bs) - ceil_div(s.num_cached + n, bs)
        return plan

    def _wait_reason(self, s: Sequence, n_running: int, budget: int, room: int, adapters: set[str],
                     running: list[Sequence], kv: KvUsage) -> str:
        """Why s cannot be admitted this step ("" = it can): room is the blocks it may take."""
        if n_running >= self.max_running:
            return f"{n_running} requests are running, the most this scheduler runs at once (--max-running)"
        if budget <= 0:
            return "running requests use the whole step's token budget (--max-batch-tokens)"
        reuse = self.reuse_prefixes and s.reuses_prefix
        if reuse and not s.cache_id and s.prefix_looked_up < 0:
            return f"{_NOT_LOOKED_UP} (it arrived after this step's lookup)"
        if reuse and (shared := awaited_prefix(s, running, kv.block_size)):
            return (f"a running request is writing the first {shared} tokens of its prompt, which it reuses once "
                    f"they are written (prefix caching)")
        need = (ceil_div(s.num_tokens + 1, kv.block_size) - ceil_div(s.num_cached, kv.block_size)
                + _shared_tail(s, kv.block_size))
        if need > room:
            ours = sum(ceil_div(r.num_cached, kv.block_size) for r in running)
            elsewhere = max(0, kv.total_blocks - kv.free_blocks - ours)
            return (f"{_NEEDS_BLOCKS} {need} KV blocks but only {max(room, 0)} can be given to it: of the executor's "
                    f"{kv.total_blocks} blocks {kv.free_blocks} are free, {ours} are held by this scheduler's "
                    f"{len(running)} running requests and {elsewhere} elsewhere (other clients of the executor)")
        adapter = s.request.adapter
        if adapter and adapter not in adapters and self.max_adapters and len(adapters) >= self.max_adapters:
            return (f"its adapter {adapter!r} needs one of the executor's {self.max_adapters} adapter slots "
                    f"(--max-adapters-on-device), all used by running requests")
        return ""

    def _chunk(self, s: Sequence, budget: int, free: int, bs: int) -> int:
        """Tokens of s's prompt to write this step: limited by the chunk size, the budget and free blocks."""
        n = min(s.remaining, self.prefill_chunk, budget)
        room = (ceil_div(s.num_cached, bs) + max(free, 0)) * bs - s.num_cached  # tokens the blocks can hold
        n = max(0, min(n, room))
        # (an image span written in one chunk: the chunk ends before it, or runs through it, within budget and room)
        return chunk_tokens(s.request.images, s.num_cached, n, min(s.remaining, budget, room)) if n else 0

    @staticmethod
    def fits_alone(tokens: int, kv: KvUsage) -> bool:
        """Whether a sequence of this many tokens fits the whole KV pool."""
        return ceil_div(tokens, kv.block_size) <= kv.total_blocks


def _shared_tail(s: Sequence, block_size: int) -> int:
    """1 when s waits with a reused prefix ending inside a block (CreateCache reused every block of its prompt
    but the last token): that block is shared, and writing the token takes a private copy of it."""
    return int(bool(s.cache_id) and s.num_cached % block_size != 0)
