"""A clean stop keeps the pool's warm prefixes (executor_service/kv/tiers/flush.py, docs/kv-transfer.md 'Tiers'), through real
executor processes: a prompt whose blocks never left the pool is written to --kv-disk-dir on SIGTERM, and the
restarted executor finds it (a prefix hit, the same next token); --kv-disk-flush-s 0 writes nothing; a SIGKILL
in the middle of the flush leaves a tier whose every file is whole, that reopens and serves no wrong token."""
from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from executor_service.kv.tiers.block_file import decode
from tandem.block_hash import chain_hashes, root_hash
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_executor

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # the tiny llama: 2 layers x K,V x 16 slots x 2 KV heads x 16 dims x fp32


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


def files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.kvb"))


def first_token(server, prompt: list[int]) -> tuple[int, int]:
    """(cached tokens CreateCache found, the greedy token after the prompt); the cache is released."""
    made = server.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)])).results[0]
    out = server.stub.Prefill(pb.PrefillRequest(token_ids=prompt[made.cached_tokens:], cache_id=made.cache.cache_id))
    server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[made.cache.cache_id]))
    return made.cached_tokens, out.output.tokens[0].token_id


def test_a_clean_stop_writes_the_pools_blocks_and_a_restart_finds_them(model_dir, tmp_path):
    disk = tmp_path / "tier"
    args = ("--kv-blocks", "12", "--kv-disk-dir", str(disk), "--kv-disk-gb", "1")
    prompt, other = prompt_of(64, seed=1), prompt_of(64, seed=2)
    server = start_executor(model_dir, *args)
    with server:
        assert first_token(server, prompt)[0] == 0
        cold, token = first_token(server, prompt)  # (in the pool now)
        assert cold == 63
        time.sleep(0.3)
        assert files(disk) == []  # 4 of 12 blocks used: nothing was evicted, so nothing spilled
        server.send_sigterm()
        assert server.wait_exit() == 0
        assert "4 KV blocks written to the disk tier" in server.stderr()  # the prompt's 4 blocks
    assert {p.stem for p in files(disk)} == {h.hex() for h in chain_hashes(root_hash(), prompt, BS)}
    server = start_executor(model_dir, *args, "--kv-disk-flush-s", "0")
    with server:  # the restart finds the prefix that was warm in the pool
        assert first_token(server, prompt) == (63, token)
        assert server.stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache.hit_tokens == 63
        first_token(server, other)
        server.send_sigterm()
        assert server.wait_exit() == 0
        assert "KV blocks written" not in server.stderr()  # --kv-disk-flush-s 0: no flush, `other` is not on disk
    assert len(files(disk)) == 4


def test_a_sigkill_mid_flush_leaves_a_tier_that_reopens(model_dir, tmp_path):
    disk = tmp_path / "tier"
    n_prompts, length = 50, 240  # 15 blocks each: 750 blocks (~6 MB) for the flush to write
    args = ("--kv-blocks", str(n_prompts * 15 + 8), "--kv-disk-dir", str(disk), "--kv-disk-gb", "1")
    prompts = [prompt_of(length, seed) for seed in range(n_prompts)]
    server = start_executor(model_dir, *args)
    try:
        tokens = [first_token(server, p)[1] for p in prompts]
        assert files(disk) == []
        server.send_sigterm()
        deadline = time.monotonic() + 30
        while not files(disk) and time.monotonic() < deadline:
            time.sleep(0.001)
        server.proc.send_signal(signal.SIGKILL)  # the first block file is there: the flush is under way
        assert server.wait_exit() == -signal.SIGKILL
    finally:
        server.process.kill()
        server.channel.close()
    written = files(disk)
    assert 0 < len(written) < n_prompts * 15, f"the SIGKILL should land in the middle of the flush: {len(written)}"
    for p in written:  # every block file is whole: written under a temporary name, then renamed
        assert decode(bytes.fromhex(p.stem), p.read_bytes(), BLOCK_BYTES) is not None, p.name
    with start_executor(model_dir, *args) as server:
        assert not list(disk.rglob("*.tmp"))  # a write cut short is dropped when the tier reopens
        on_disk = {p.stem for p in written}
        # the most recent prompt's head block is written first: the restart finds at least it
        for i in (n_prompts - 1, n_prompts - 2, 0):
            hashes = chain_hashes(root_hash(), prompts[i], BS)
            expected = 0
            while expected < len(hashes) and hashes[expected].hex() in on_disk:
                expected += 1
            cached, token = first_token(server, prompts[i])
            # a prompt found whole still computes its last token (the next token comes from it)
            assert (cached, token) == (min(expected * BS, len(prompts[i]) - 1), tokens[i]), i
            if i == n_prompts - 1:
                assert cached >= BS
