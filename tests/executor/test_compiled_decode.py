"""The compiled decode step (--compile, models/decode/compiled.py) on CPU: the attention forms it uses, and
the executor with it against transformers / peft and against the eager path — greedy runs, mixed batches
(prefill chunks beside decodes, releases), LoRA (which stays eager beside compiled base steps), a fault in
the compiled call, and a real `--compile` server on Qwen3-MoE.

Each compiled executor costs a compile (~15-30 s per tiny model on 2 cores): one in-process executor is shared by the
module, and one real server (on the MoE model) is started.

The in-process executor's tests run on each device (tests/devices.py): on CUDA (Triton's kernels, bfloat16, within
its tolerance of the CPU float32 references: tests/device_tolerances.py) always, on the CPU where
TANDEM_TEST_COMPILED_EXECUTOR is set (the compile is the cost). The MoE server stays on the CPU (a router near tie,
docs/cuda.md).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from executor_service.types import CacheRef, DecodeItem
from models.decode.compiled import CompiledDecode, set_compile_cache_dir
from models.attention.decode import attend_gathered, write_kv
from tests.executor.test_lora_parity import ADAPTERS, Setup as LoraSetup
from tests.device_tolerances import greedy_agreement
from tests.executor_driver import LOGITS, assert_greedy_matches, greedy_run, make_executor, mixed_batch_run
from tests.hf_reference import HfReference, rel_err

TOL = 1e-4
STEPS = 32


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def pools(blocks: int = 12, block_size: int = 4, kv_heads: int = 2, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(blocks, block_size, kv_heads, d, generator=g),
            torch.randn(blocks, block_size, kv_heads, d, generator=g))


def test_attention_through_block_tables_equals_a_per_item_reference():
    k_pool, v_pool = pools()
    tables = torch.tensor([[3, 7, 0, 0], [1, 2, 4, 5], [11, 0, 0, 0]])  # width 4, padded with block 0
    lens = torch.tensor([6, 16, 1])
    q = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))  # 6 heads over 2 KV heads
    got = attend_gathered(q, k_pool, v_pool, tables, lens, 0.3)  # [B, heads * d]
    for b in range(3):  # plain softmax attention over the item's own keys, head by head
        n = int(lens[b])
        keys = k_pool[tables[b]].reshape(-1, 2, 8)[:n]  # [n, kv_heads, d]
        values = v_pool[tables[b]].reshape(-1, 2, 8)[:n]
        for h in range(6):
            probs = torch.softmax(0.3 * keys[:, h // 3] @ q[b, h], dim=0)  # [n]
            assert torch.allclose(got[b, h * 8:(h + 1) * 8], probs @ values[:, h // 3], atol=1e-5)


def test_write_kv_writes_its_slots_only():
    k_pool, v_pool = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    ticket = write_kv(k_pool, v_pool, torch.tensor([5, 9]), k, v)
    assert ticket.item() == 0
    flat_k, flat_v = k_pool.view(-1, 2, 8), v_pool.view(-1, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[9], k[1]) and torch.equal(flat_v[9], v[1])
    assert int(flat_k.ne(0).any(-1).any(-1).sum()) == 2 and int(flat_v.ne(0).any(-1).any(-1).sum()) == 2


# Each compile costs ~30 s on CI's 2 cores, which the suite's 15-minute budget does not hold with everything
# else (measured 15:05 with the server test alone): the tests that compile run when
# TANDEM_TEST_COMPILED_EXECUTOR=1 (they passed on the commit that added this gate: 9 passed in 69 s). On CUDA
# they always run (gpu_check's CUDA tests).
COMPILE_GATE = "set TANDEM_TEST_COMPILED_EXECUTOR=1 (one more compile: ~30 s)"
IN_PROCESS = pytest.mark.skipif(not os.environ.get("TANDEM_TEST_COMPILED_EXECUTOR"), reason=COMPILE_GATE)


@pytest.fixture(scope="module")
def lora(tiny_checkpoint, tmp_path_factory, device) -> LoraSetup:
    if device.name == "cpu" and not os.environ.get("TANDEM_TEST_COMPILED_EXECUTOR"):
        pytest.skip(COMPILE_GATE)  # (before the adapters are made: the CPU run costs nothing)
    pytest.importorskip("peft", reason="the adapters are written with peft (a lent GPU's bundle may lack it)")
    return LoraSetup(tiny_checkpoint("llama"), tmp_path_factory.mktemp("lora-compiled"), ADAPTERS)


@pytest.fixture(scope="module")
def llama(lora, device):
    """One compiled executor (with two adapters preloaded) for the module: each compile costs seconds."""
    return lora.base, lora.executor(preload=("qv4", "mlp16"), compile=True, device=device), HfReference(lora.base)


def test_greedy_matches_transformers_compiled(llama, device):
    model_dir, ex, hf = llama
    prompt = prompt_of(21, seed=1)
    before = ex.compiled.calls
    ref_tokens, ref_logits = hf.greedy(prompt, STEPS)
    assert_greedy_matches(ex, prompt, ref_tokens, ref_logits, STEPS, device.dtype)
    assert ex.compiled.calls - before == STEPS - 1  # every decode step ran compiled (the prefill eager)
    assert "compiled_decode" in ex.info().capabilities
    assert "compiled_decode" not in make_executor(model_dir, device=device).info().capabilities


def test_mixed_batches_match_the_eager_executor(llama, device):
    """Prefill chunks beside decodes (eager steps) and all-decode steps (compiled), sequences released
    mid-way, batch sizes 1 to 5 and growing tables: token for token the eager executor's results."""
    model_dir, ex, _ = llama
    eager = make_executor(model_dir, device=device)
    prompts = [prompt_of(n, seed=10 + n) for n in (3, 30, 9, 17, 40)]
    release = {1: 10, 3: 20}
    before = ex.compiled.calls
    got = mixed_batch_run(ex, prompts, 24, release)
    want = mixed_batch_run(eager, prompts, 24, release)
    assert ex.compiled.calls - before >= 10
    assert eager.compiled is None
    for i in range(len(prompts)):
        greedy_agreement(got[0][i], got[1][i], want[0][i], want[1][i], device.dtype, f"sequence {i}")
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks  # everything released: nothing leaked


def test_a_failed_compiled_step_changes_nothing(llama, monkeypatch):
    """A fault inside the compiled call (injected: the compiled function raises) fails the call and leaves
    every cache and the pool as they were; the next step runs."""
    _, ex, _ = llama
    results = [ex.prefill(prompt_of(n, seed=n), output=LOGITS) for n in (12, 16)]  # 16: the next token needs a block
    usage = ex.kv_usage()

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")
    items = [DecodeItem(CacheRef(r.cache.cache_id, r.cache.seq_len), r.output.tokens[0].token_id, output=LOGITS)
             for r in results]
    real = ex.compiled._forward
    monkeypatch.setattr(ex.compiled, "_forward", broken)
    with pytest.raises(RuntimeError, match="injected"):
        ex.decode(items)
    assert ex.kv_usage() == usage
    monkeypatch.setattr(ex.compiled, "_forward", real)
    assert [d.cache.seq_len for d in ex.decode(items)] == [13, 17]
    ex.release_cache([r.cache.cache_id for r in results])


def test_lora_items_run_eager_beside_compiled_base_steps(llama, lora, device):
    _, ex, _ = llama
    setup = lora
    before = ex.compiled.calls
    seqs = [("", 9), ("qv4", 17), ("mlp16", 5)]
    prompts = [prompt_of(n, seed=40 + i) for i, (_, n) in enumerate(seqs)]
    gen, logits = mixed_batch_run(ex, prompts, 16, release_after={1: 6, 2: 8}, adapters=[a for a, _ in seqs])
    assert ex.compiled.calls > before  # the base sequence's steps alone, once the adapters' sequences were released
    for i, (adapter, _) in enumerate(seqs):
        ref_tokens, ref_logits = setup.greedy(adapter, prompts[i], len(gen[i]))
        greedy_agreement(gen[i], logits[i], ref_tokens, ref_logits, device.dtype, f"sequence {i} ({adapter or 'base'})")


@IN_PROCESS
def test_moe_server_with_compile_matches_transformers(tiny_checkpoint):
    """`python -m executor_service --compile` (a real process) on Qwen3-MoE (its MoE layers run eager between
    compiled segments): two sequences through UnifiedDecode — a prefill beside a decode (an eager, mixed call),
    then both decoding (compiled, batch 2), then one alone (compiled, padded batch 1) — give transformers'
    greedy tokens and logits."""
    from executor_service.rpc import codec
    from tandem.executor.v1 import executor_pb2 as pb
    from tests.grpc_harness import start_executor
    model_dir = tiny_checkpoint("qwen3_moe", config_overrides=dict(num_experts=8, num_experts_per_tok=2,
                                                                    norm_topk_prob=True))
    hf = HfReference(model_dir)
    prompts = [prompt_of(19, seed=5), prompt_of(30, seed=6)]
    refs = [hf.greedy(p, 12) for p in prompts]
    with start_executor(model_dir, "--compile") as server:
        assert "compiled_decode" in server.stub.GetInfo(pb.GetInfoRequest()).capabilities
        logits_mode = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
        caches, got, logits = ["", ""], [[], []], [[], []]

        def step(which: list[int]) -> None:
            items = [pb.UnifiedItem(cache_id=caches[i], token_ids=[got[i][-1]] if got[i] else prompts[i],
                                    pos_offset=len(prompts[i]) + len(got[i]) - 1 if got[i] else 0,
                                    is_final_chunk=True, output=logits_mode) for i in which]
            for i, r in zip(which, server.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=items)).results):
                assert r.status.code == 0, r.status.message
                caches[i] = r.cache.cache_id
                got[i].append(r.output.tokens[0].token_id)
                logits[i].append(codec.decode_logits(r.output.logits).reshape(-1))
        step([0])
        step([0, 1])  # decode + prefill: eager
        for _ in range(9):
            step([0, 1])  # compiled, batch 2
        step([0])  # compiled, batch 1 (padded)
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        n = len(got[i])
        assert got[i] == ref_tokens[:n], f"sequence {i}"
        for a, b in zip(logits[i], ref_logits):
            assert rel_err(torch.from_numpy(a.copy()), b) < TOL


def test_compile_cache_dir_is_where_inductor_caches(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # restored after the test
    set_compile_cache_dir(tmp_path / "inductor")
    assert cache_dir() == str((tmp_path / "inductor").resolve()) and (tmp_path / "inductor").is_dir()


def test_compile_refuses_quantized_weights(tiny_checkpoint):
    ex = make_executor(tiny_checkpoint("llama"), quantization="int8")
    with pytest.raises(ValueError, match="--quantization"):
        CompiledDecode(ex.model, ex.kv)
