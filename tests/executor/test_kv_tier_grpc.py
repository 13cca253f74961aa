"""The disk tier through real executor processes (docs/kv-transfer.md, 'Tiers'): blocks the pool evicts are
written to --kv-disk-dir in the background and loaded back when a prompt's prefix misses the pool; a restarted
executor finds them again (the prefix hit is counted); a corrupt block file is ignored (and deleted); the tier
stays within --kv-disk-gb."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_executor

KV_BLOCKS = 12
BS = 16


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


def files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.kvb"))


def wait_files(d: Path, n: int) -> list[Path]:
    deadline = time.monotonic() + 30
    while len(files(d)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return files(d)


def first_token(server, prompt: list[int]) -> tuple[int, int]:
    """(cached tokens CreateCache found, the greedy token after the prompt); the cache is released."""
    made = server.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)])).results[0]
    cached = made.cached_tokens
    out = server.stub.Prefill(pb.PrefillRequest(token_ids=prompt[cached:], cache_id=made.cache.cache_id))
    server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[made.cache.cache_id]))
    return cached, out.output.tokens[0].token_id


def evict_everything(server) -> None:
    for seed in range(100, 104):  # 4 x 3 blocks of other prompts: every block of the pool rewritten
        first_token(server, prompt_of(48, seed))


def test_disk_tier_reloads_spilled_blocks_and_survives_a_restart(model_dir, tmp_path):
    disk = tmp_path / "tier"
    args = ("--kv-blocks", str(KV_BLOCKS), "--kv-disk-dir", str(disk), "--kv-disk-gb", "1")
    prompt = prompt_of(64, seed=1)
    with start_executor(model_dir, *args) as server:
        cold, token = first_token(server, prompt)
        assert cold == 0
        evict_everything(server)
        assert len(wait_files(disk, 4)) >= 4  # the prompt's 4 blocks (and others) spilled
        cached, again = first_token(server, prompt)
        assert (cached, again) == (63, token)  # loaded back from disk: the same next token
    with start_executor(model_dir, *args) as server:  # a restart: the tier's index reopens
        cached, again = first_token(server, prompt)
        assert (cached, again) == (63, token)
        stats = server.stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache
        assert stats.hit_tokens == 63
        # a corrupt block file is ignored (and deleted): the match stops before it
        evict_everything(server)
        other = prompt_of(64, seed=2)
        first_token(server, other)
        evict_everything(server)
        wait_files(disk, 8)
    from tandem.block_hash import chain_hashes, root_hash
    h = chain_hashes(root_hash(), other, BS)
    (victim,) = [p for p in files(disk) if p.stem == h[2].hex()]
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF
    victim.write_bytes(bytes(raw))
    truncated = [p for p in files(disk) if p.stem == h[0].hex()][0]
    with start_executor(model_dir, *args) as server:
        cached, _ = first_token(server, other)
        assert cached == 2 * BS  # blocks 0 and 1, not the corrupt block 2 nor what follows it
        assert not victim.exists()
        truncated.write_bytes(truncated.read_bytes()[:100])  # a truncated file found after the start: ignored too
    with start_executor(model_dir, *args) as server:
        assert not truncated.exists()  # dropped when the index reopened
        cached, _ = first_token(server, other)
        assert cached == 0


def test_disk_tier_stays_within_its_size(model_dir, tmp_path):
    disk = tmp_path / "small"
    with start_executor(model_dir, "--kv-blocks", str(KV_BLOCKS), "--kv-disk-dir", str(disk),
                        "--kv-disk-gb", "0.0003") as server:  # ~315 KB
        for seed in range(20):
            first_token(server, prompt_of(48, seed))
        time.sleep(0.5)
        size = sum(p.stat().st_size for p in files(disk))
        assert 0 < size <= 0.0003 * 2**30
