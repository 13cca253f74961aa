"""scheduler.fleet.router: the score (affinity, free KV, load), the choice, and the PrefixIndex of an executor."""
from __future__ import annotations

from scheduler.fleet.router import AFFINITY, Candidate, PrefixIndex, choose, prompt_hashes, score
from tandem.block_hash import chain_hashes, root_hash

BS = 16
PROMPT = list(range(1, 101))  # 100 tokens: 6 reusable blocks (96 tokens)


def cand(name: str, free: int = 100, total: int = 100, pending: int = 0, budget: int = 512, cached: int = 0):
    return Candidate(name, free, total, pending, budget, cached)


def test_prompt_hashes_are_the_executors_block_hashes_and_leave_the_last_token():
    hashes = prompt_hashes(PROMPT, "", BS)
    assert hashes == chain_hashes(root_hash(), PROMPT, BS)[:6]  # base model: the executor's own root
    assert len(prompt_hashes(PROMPT[:96], "", BS)) == 5  # 96 tokens: the last block holds the last token
    assert prompt_hashes(PROMPT, "alpha", BS) != hashes  # another adapter, another chain


def test_the_score_adds_affinity_and_free_kv_and_subtracts_load():
    idle = cand("a")
    assert score(idle, 100) == 1.0  # all free, nothing queued, nothing cached
    assert score(cand("b", cached=96), 100) == AFFINITY * 0.96 + 1.0
    assert score(cand("c", free=50), 100) == 0.5
    assert score(cand("d", pending=512, budget=512), 100) == 0.5  # one step's worth queued


def test_a_cached_prefix_wins_over_free_kv_and_a_light_load():
    cached = cand("cached", free=20, pending=256, cached=96)
    fresh = cand("fresh")
    assert choose([fresh, cached], 100).name == "cached"


def test_a_deep_queue_outweighs_a_small_cached_prefix():
    busy = cand("busy", pending=100_000, cached=16)  # one block of 100 tokens cached, far behind
    assert choose([busy, cand("idle")], 100).name == "idle"


def test_load_spreads_requests_and_ties_go_to_the_first():
    assert choose([cand("a", pending=40), cand("b")], 100).name == "b"
    assert choose([cand("a"), cand("b")], 100).name == "a"
    assert choose([], 100) is None


def test_prefix_index_counts_the_leading_run_from_events_and_routing():
    index = PrefixIndex(max_routed=4)
    hashes = prompt_hashes(PROMPT, "", BS)
    index.store(hashes[:2])  # the executor reported two blocks
    assert index.cached_blocks(hashes) == 2
    index.routed(hashes[2:4])  # this scheduler sent the prompt there: the next blocks will be
    assert index.cached_blocks(hashes) == 4
    index.remove([hashes[1]])  # evicted: the run stops before it
    assert index.cached_blocks(hashes) == 1
    index.routed(prompt_hashes(list(range(500, 600)), "", BS))  # routed memory is bounded (LRU)
    assert index.cached_blocks(hashes) == 1
    index.clear()
    assert index.cached_blocks(hashes) == 0
