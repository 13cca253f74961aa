"""The KV follower's view of an executor with KV tiers: a block is in the router's index while any medium
(the pool "GPU", the host tier "CPU", the disk tier "DISK") holds it."""
from __future__ import annotations

from scheduler.fleet.kv_follower import MediumIndex
from scheduler.fleet.router import PrefixIndex

A, B = b"a" * 16, b"b" * 16


def test_a_block_spilled_to_a_tier_stays_and_leaves_with_its_last_medium() -> None:
    index = PrefixIndex()
    media = MediumIndex(index)
    media.store([A, B], "GPU")
    media.remove([A], "GPU")  # evicted from the pool...
    media.store([A], "DISK")  # ...and spilled to disk: still a hit
    assert index.cached_blocks([A, B]) == 2
    media.store([A], "GPU")  # loaded back; then the disk tier drops its copy for space
    media.remove([A], "DISK")
    assert index.cached_blocks([A]) == 1
    media.remove([A], "GPU")
    assert index.cached_blocks([A, B]) == 0


def test_an_older_executor_without_media_is_the_pool() -> None:
    index = PrefixIndex()
    media = MediumIndex(index)
    media.store([A], "")
    media.remove([A], "GPU")
    assert index.cached_blocks([A]) == 0
    media.store([B], "GPU")
    media.clear()
    assert index.cached_blocks([B]) == 0
