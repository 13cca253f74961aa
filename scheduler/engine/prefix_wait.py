"""Waiting for a prefix that is being written: with the executor's prefix cache, a request whose prompt starts
with blocks another running request is computing right now is better held back for the few steps until they
are written (and indexed) than admitted at once to compute the same blocks a second time.

Without this, a burst of requests sharing a long system prompt (eight arriving together) all compute it
side by side: none of its blocks is cached when they are looked up. Held back, the first computes it and the
others reuse it, each computing only its own suffix, which is sooner for them too.

The hold lasts only while a running request is still writing the shared blocks: it ends when they are
written, or when that request stops running (finished, preempted), so it cannot starve anyone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from scheduler.sequence import Sequence


@dataclass(frozen=True)
class SharedPrefix:
    """What seq's prompt shares with running requests (tokens, whole blocks, never all of the prompt)."""
    written: int  # the longest shared run a running request has written: reusable now
    writing: int  # the longest shared run a running request is still writing

    def awaited(self, held: int) -> int:
        """Tokens worth waiting for, given the held tokens seq's cache holds already (0: none)."""
        return self.writing if self.writing > max(self.written, held) else 0


def shared_prefix(seq: Sequence, running: Iterable[Sequence], block_size: int) -> SharedPrefix:
    """Compares seq's prompt with those of the running requests of the same adapter, block by block."""
    prompt = seq.request.prompt_ids
    max_blocks = (seq.num_tokens - 1) // block_size
    written = writing = 0
    for other in running:
        if other is seq or other.request.adapter != seq.request.adapter:
            continue
        theirs = other.request.prompt_ids
        limit = min(max_blocks, len(theirs) // block_size)
        if limit <= max(written, writing):
            continue
        shared = _shared_blocks(prompt, theirs, limit, block_size)
        done = min(shared, other.num_cached // block_size)  # its blocks already written
        written = max(written, done)
        if shared > done:
            writing = max(writing, shared)
    return SharedPrefix(written * block_size, writing * block_size)


def awaited_prefix(seq: Sequence, running: Iterable[Sequence], block_size: int) -> int:
    """Tokens at the start of seq's prompt that a running request is still writing and seq would reuse by
    waiting: more than its cache holds and than any running request has written already (0: don't wait)."""
    return shared_prefix(seq, running, block_size).awaited(seq.num_cached)


def _shared_blocks(a: tuple[int, ...], b: tuple[int, ...], limit: int, block_size: int) -> int:
    """How many whole blocks (at most limit) a and b have in common from their start."""
    n = 0
    while n < limit and a[n * block_size:(n + 1) * block_size] == b[n * block_size:(n + 1) * block_size]:
        n += 1
    return n
