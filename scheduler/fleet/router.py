"""Which executor a new request goes to, when one scheduler drives several (scheduler/fleet/fleet.py).

Every executor that serves, and holds the request's adapter, is a candidate; each gets

    score = AFFINITY * cached / prompt  +  free_kv  -  load

- cached / prompt: the share of the request's prompt (whole blocks) already cached there — the longest run
  of its block hashes (tandem/block_hash.py, chained as the executor chains them) that the executor
  reported storing through its KV events (SubscribeKvEvents), or that this scheduler routed there recently
  (those blocks are there once computed: a burst of requests sharing a system prompt follows the first);
- free_kv: free KV blocks / all blocks (cached-evictable ones count as free);
- load: tokens queued there and not computed yet (waiting prompts, the rest of running prompts, one per
  decoding request), as a share of that plus one step's token budget: 0 idle, towards 1 deeply queued.

AFFINITY = 2: reusing a whole cached prompt outweighs any difference in free KV, and is given up only for
an executor far less loaded — recomputing a prompt elsewhere is cheaper than queueing behind a long line.
Ties go to the executor listed first. Adapters: the executor's own KV events carry hashes rooted in the
adapter's weights digest, which the scheduler does not know, so requests naming an adapter use only what
this scheduler routed (same adapter name) for affinity.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from tandem.block_hash import chain_hashes, root_hash

AFFINITY = 2.0
MAX_ROUTED_BLOCKS = 65536  # per executor: hashes remembered from routing (least recently routed dropped)


class PrefixIndex:
    """The block hashes one executor holds, as far as the scheduler knows: stored per its KV events (a
    snapshot first, then changes), and routed there by this scheduler."""

    def __init__(self, max_routed: int = MAX_ROUTED_BLOCKS) -> None:
        self.stored: set[bytes] = set()
        self._routed: OrderedDict[bytes, None] = OrderedDict()
        self._max_routed = max_routed

    def store(self, hashes: Iterable[bytes]) -> None:
        self.stored.update(hashes)

    def remove(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.stored.discard(h)
            self._routed.pop(h, None)

    def clear(self) -> None:
        """The executor restarted or its event stream was lost: what it held is unknown again."""
        self.stored.clear()
        self._routed.clear()

    def routed(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._routed[h] = None
            self._routed.move_to_end(h)
        while len(self._routed) > self._max_routed:
            self._routed.popitem(last=False)

    def cached_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of hashes, from the first, the executor holds (or will once computed)."""
        n = 0
        for h in hashes:
            if h not in self.stored and h not in self._routed:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Candidate:
    """One executor as the router sees it."""
    name: str
    free_blocks: int
    total_blocks: int
    pending_tokens: int  # queued there and not computed yet
    step_budget: int  # its per-step token budget
    cached_tokens: int  # of the request's prompt, cached there (PrefixIndex.cached_blocks x block size)


def prompt_hashes(prompt: Sequence[int], adapter: str, block_size: int, cache_salt: str = "") -> list[bytes]:
    """The block hashes a prompt's reusable prefix would have (never its last token: that one is computed)."""
    return chain_hashes(root_hash(adapter, cache_salt=cache_salt), prompt, block_size, max_blocks=max(0, len(prompt) - 1) // block_size)


def score(c: Candidate, prompt_tokens: int) -> float:
    affinity = c.cached_tokens / max(1, prompt_tokens)
    free = c.free_blocks / max(1, c.total_blocks)
    load = c.pending_tokens / (c.pending_tokens + max(1, c.step_budget))
    return AFFINITY * affinity + free - load


def choose(candidates: Sequence[Candidate], prompt_tokens: int) -> Candidate | None:
    """The best-scored candidate (the first of equals); None when there is none."""
    best, best_score = None, 0.0
    for c in candidates:
        s = score(c, prompt_tokens)
        if best is None or s > best_score:
            best, best_score = c, s
    return best
