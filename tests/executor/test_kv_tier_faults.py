"""The disk tier's faults through a real executor process on a real small file system (a tmpfs: tests/small_fs.py;
docs/kv-transfer.md, 'Disk faults'):
- a full disk: writes stop (counted, the tier marked not writable, logged once), every request is still answered
  with the tokens it got on a healthy disk (the host tier or recompute), then writes resume once there is room;
- a read-only directory: the executor refuses to start, saying why;
- the directory deleted under the running executor: the tier's index is dropped (reads miss, counted), requests
  recompute, and the next write recreates the directory.
The executor runs with --kv-disk-fsync (a flag that needs a disk tier: checked first). Each fault test also runs requests side by side under the fault and checks that the KV pool is whole afterwards
(every block free, no cache left)."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from executor_service.kv.tiers.config import add_flags, from_args
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_executor
from tests.small_fs import fill, mount_refused, remount, tmpfs

KV_BLOCKS = 16
BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # the tiny llama: 2 layers x K,V x 16 slots x 2 KV heads x 16 dims x fp32
HOST_GB = 3.5 * BLOCK_BYTES / 2**30  # a host tier of 3 blocks: most evicted blocks have only the disk
PROMPTS = 10  # of 48 tokens (3 blocks): 30 blocks through a pool of 16, so the pool evicts
DISK = (("medium", "DISK"),)


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(48)]


def generate(server, prompt: list[int], steps: int = 3) -> tuple[int, list[int]]:
    """(tokens CreateCache found cached, the greedy tokens after the prompt); the cache is released."""
    made = server.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)])).results[0]
    cid = made.cache.cache_id
    try:
        first = server.stub.Prefill(pb.PrefillRequest(token_ids=prompt[made.cached_tokens:], cache_id=cid))
        token = first.output.tokens[0].token_id
        (d,) = server.stub.Decode(pb.DecodeRequest(num_steps=steps, items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=cid, seq_len=len(prompt)), token_id=token)])).results
        return made.cached_tokens, [token, *(t.token_id for t in d.output.tokens)]
    finally:
        server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cid]))


def run_all(server, seeds: list[int]) -> dict[int, list[int]]:
    """Every seed's prompt generated, three at a time (requests side by side, as a scheduler's batch)."""
    with cf.ThreadPoolExecutor(3) as pool:
        return dict(zip(seeds, pool.map(lambda s: generate(server, prompt_of(s))[1], seeds)))


def scrape(server) -> dict[tuple[str, tuple], float]:
    url = re.search(r"metrics on (http://\S+/metrics)", server.stderr()).group(1)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(server, name: str) -> float:
    m = scrape(server)
    return m.get((name, ()), m.get((name, DISK), 0.0))


def assert_pool_whole(server) -> None:
    kv = server.stub.GetMetrics(pb.GetMetricsRequest()).kv
    assert (kv.free_blocks, kv.active_caches) == (kv.total_blocks, 0), f"KV leaked: {kv}"


def until(cond, what: str, timeout_s: float = 30.0, poke=None) -> None:
    """Waits for cond(), calling poke() between tries (something that makes the executor spill blocks)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if poke is not None:
            poke()
        time.sleep(0.05)


def test_kv_disk_fsync_needs_a_disk_tier():
    ap = argparse.ArgumentParser()
    add_flags(ap)
    assert from_args(ap.parse_args(["--kv-disk-dir", "/x", "--kv-disk-gb", "1", "--kv-disk-fsync"])).disk_fsync
    assert not from_args(ap.parse_args(["--kv-disk-dir", "/x", "--kv-disk-gb", "1"])).disk_fsync  # off by default
    with pytest.raises(ValueError, match="--kv-disk-fsync needs a disk tier"):
        from_args(ap.parse_args(["--kv-disk-fsync"]))


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    why = mount_refused()
    if why:
        pytest.skip(f"the disk-fault tests need a real small file system: {why}")
    with tmpfs(tmp_path_factory.mktemp("kvfs") / "mnt", "1m") as mnt:
        yield mnt


@pytest.fixture(scope="module")
def server(model_dir, mounted):
    s = start_executor(model_dir, "--kv-blocks", str(KV_BLOCKS), "--kv-host-gb", f"{HOST_GB:.12f}",
                       "--kv-disk-dir", str(mounted / "tier"), "--kv-disk-gb", "1", "--kv-disk-fsync",
                       "--metrics-port", "0")  # (fsync on: its path runs; the default's runs in test_kv_tier_grpc)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(server) -> dict[int, list[int]]:
    """Each prompt's tokens on a healthy disk (before any test's fault)."""
    return run_all(server, list(range(PROMPTS)))


def test_a_full_disk_stops_writes_not_serving(server, mounted, reference):
    filler = fill(mounted)  # something else filled the disk
    log_before = server.stderr()
    errors_before = metric(server, "tandem:executor_kv_tier_write_errors_total")
    try:
        for _ in range(3):  # evictions spill into the full disk, again and again
            assert run_all(server, list(range(PROMPTS))) == reference
        until(lambda: metric(server, "tandem:executor_kv_tier_write_errors_total") >= errors_before + 2,
              "refused writes counted", poke=lambda: run_all(server, [0, 5]))
        assert metric(server, "tandem:executor_kv_tier_disk_writable") == 0
        new_log = server.stderr()[len(log_before):]
        assert new_log.count("disk tier: writes stopped: the disk is full") == 1, new_log  # once, not per block
        assert "INTERNAL" not in new_log and "Traceback" not in new_log
        assert_pool_whole(server)
    finally:
        filler.unlink()
    written = metric(server, "tandem:executor_kv_tier_written_blocks_total")
    # room again: the next write after the retry pause goes through
    until(lambda: metric(server, "tandem:executor_kv_tier_written_blocks_total") > written,
          "writes resumed", poke=lambda: run_all(server, list(range(PROMPTS))))
    assert metric(server, "tandem:executor_kv_tier_disk_writable") == 1
    assert server.stderr()[len(log_before):].count("disk tier: writes resumed") == 1
    assert run_all(server, list(range(PROMPTS))) == reference
    assert_pool_whole(server)


def test_the_directory_deleted_under_the_executor(server, mounted, reference):
    tier = mounted / "tier"
    until(lambda: metric(server, "tandem:executor_kv_tier_blocks") >= 8, "blocks on disk",
          poke=lambda: run_all(server, list(range(PROMPTS))))
    missing_before = metric(server, "tandem:executor_kv_tier_missing_files_total")
    shutil.rmtree(tier)
    got = run_all(server, list(range(PROMPTS)))  # prefixes the index still names: reads miss, recomputed
    assert got == reference
    until(lambda: any(tier.rglob("*.kvb")), "the directory recreated by a write",
          poke=lambda: run_all(server, list(range(PROMPTS))))
    assert metric(server, "tandem:executor_kv_tier_missing_files_total") > missing_before
    assert metric(server, "tandem:executor_kv_tier_disk_writable") == 1
    assert (tier / next(tier.iterdir()).name / "FINGERPRINT").exists()
    assert "its directory was deleted under the executor" in server.stderr()
    # the tier serves again from the recreated directory: prompts evicted to it come back from disk
    hits = metric(server, "tandem:executor_kv_tier_hits_total")
    until(lambda: metric(server, "tandem:executor_kv_tier_hits_total") > hits, "a prefix loaded from the new "
          "directory", poke=lambda: run_all(server, list(range(PROMPTS))))
    assert run_all(server, list(range(PROMPTS))) == reference
    assert_pool_whole(server)


def test_a_read_only_directory_refuses_the_start(model_dir, tmp_path):
    if mount_refused():
        pytest.skip(mount_refused())
    with tmpfs(tmp_path / "ro", "64k") as ro:
        remount(ro, "ro")
        r = server_process.run_to_exit("executor_service", "--model", str(model_dir), "--port", "0", "--device",
                                       "cpu", "--kv-disk-dir", str(ro / "tier"), "--kv-disk-gb", "1", timeout=300)
        assert r.returncode == 2, r.stderr[-3000:]
        assert "--kv-disk-dir cannot hold the disk tier: the file system is read-only" in r.stderr
        assert "Traceback" not in r.stderr
        assert not (ro / "tier").exists()
