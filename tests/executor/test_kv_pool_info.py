"""The KV pool's sizing and the process's resident memory as a user sees them: the startup log, GetInfo and
GetMetrics of a real executor started with default KV flags (tiny llama: max_seq_len 256)."""
from __future__ import annotations

import pytest
import torch

from executor_service.kv.sizing import DEFAULT_MAX_SEQUENCES
from models.kv.paged_cache import PagedKvCache
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for

MAX_SEQ_LEN, BLOCK = 256, 16
BLOCKS = DEFAULT_MAX_SEQUENCES * MAX_SEQ_LEN // BLOCK  # the CPU default's cap binds for so short a model
PER_BLOCK = PagedKvCache.bytes_per_block(2, BLOCK, 2, 16, torch.float32)


@pytest.fixture(scope="module")
def server(request, model_dir):
    return start_for(request, model_dir)  # no --kv-blocks / --kv-memory-fraction: the CPU default


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_get_info_states_the_pool_and_why(server):
    info = server.stub.GetInfo(pb.GetInfoRequest())
    assert info.HasField("kv_pool")
    pool = info.kv_pool
    assert pool.blocks == info.kv.total_blocks == BLOCKS
    assert pool.tokens == BLOCKS * info.kv.block_size == BLOCKS * BLOCK
    assert pool.bytes == BLOCKS * PER_BLOCK
    assert pool.reason.startswith(f"CPU default: what {DEFAULT_MAX_SEQUENCES} sequences of max_seq_len "
                                  f"{MAX_SEQ_LEN} tokens need")


def test_startup_log_states_the_pool_and_resident_memory(server):
    log = server.stderr()
    assert f"KV pool: {BLOCKS} blocks = {BLOCKS * BLOCK} tokens, 0.01 GiB: CPU default: what" in log
    assert "resident memory" in log.split("ready in", 1)[1]


def test_resident_memory_in_get_info_and_get_metrics(server):
    rss = vm_rss(server.proc.pid)
    info = server.stub.GetInfo(pb.GetInfoRequest()).resident_memory_bytes
    metrics = server.stub.GetMetrics(pb.GetMetricsRequest()).resident_memory_bytes
    for reported in (info, metrics):  # the same process's RSS, read a moment apart
        assert 0.5 * rss < reported < 2 * rss, (reported, rss)
