"""The native decode kernel (`--decode-kernel native`, models/decode/native.py) against transformers and the
PyTorch step: greedy runs on every dense architecture (Qwen2's biases, Qwen3's q/k norms), mixed batches with
chunks and releases, LoRA beside native base steps, quantized weights, batch invariance, a failed step that
changes nothing, the op's own checks of what it is given, the choice of kernel (auto / native / torch /
--compile) and its refusals and fallbacks (no compiler, a failed build), the library's build cache, and a real
executor process.

`auto` is the default, so the rest of the suite runs its decode steps natively too wherever it can; the
eager step (`--decode-kernel torch`) is checked against transformers here.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.step.decode_choice import choose_decode
from executor_service.types import CacheRef, DecodeItem
from models.decode.native import (NativeBuild, NativeDecode, build_library, load_kernel, machine_refusal,
                                  native_refusal)
from tandem import server_process
from tests.executor.test_lora_parity import ADAPTERS, Setup as LoraSetup
from tests.executor_driver import (LOGITS, assert_greedy_matches, greedy_run, make_executor, mixed_batch_run,
                                   teacher_forced_logits)
from tests.hf_reference import HfReference, rel_err

TOL = 1e-4
STEPS = 24

# The tests need the kernel: an x86-64 CPU with AVX2/FMA/F16C, g++ and ninja.
pytestmark = pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernel: {machine_refusal()}")


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_greedy_matches_transformers(tiny_checkpoint, arch, kernel):
    model_dir = tiny_checkpoint(arch)
    ex = make_executor(model_dir, decode_kernel=kernel)
    prompt = prompt_of(21, seed=1)
    ref_tokens, ref_logits = HfReference(model_dir).greedy(prompt, STEPS)
    before = ex.decode_step.calls if ex.decode_step else 0
    assert_greedy_matches(ex, prompt, ref_tokens, ref_logits, STEPS)
    if kernel == "native":
        assert ex.decode_step.calls - before == STEPS - 1  # every decode step ran natively (the prefill eager)
        assert "native_decode" in ex.info().capabilities
    else:
        assert ex.decode_step is None and "native_decode" not in ex.info().capabilities


def test_mixed_batches_match_the_eager_executor(tiny_checkpoint):
    """Prefill chunks beside decodes (eager calls) and all-decode calls (native), sequences released mid-way,
    batch sizes 1 to 5 and tables growing past several blocks: the eager executor's tokens and logits."""
    model_dir = tiny_checkpoint("qwen3")
    ex, eager = make_executor(model_dir, decode_kernel="native"), make_executor(model_dir, decode_kernel="torch")
    prompts = [prompt_of(n, seed=10 + n) for n in (3, 30, 9, 17, 40)]
    release = {1: 10, 3: 20}
    got = mixed_batch_run(ex, prompts, 24, release)
    want = mixed_batch_run(eager, prompts, 24, release)
    assert ex.decode_step.calls >= 10
    for i in range(len(prompts)):
        assert got[0][i] == want[0][i], f"sequence {i}"
        for a, b in zip(got[1][i], want[1][i]):
            assert rel_err(a, b) < TOL
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks  # everything released: nothing leaked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_never_depends_on_its_batch(tiny_checkpoint, dtype):
    """The kernel computes every row the same way in any batch (1, 3 or 5 rows): bit for bit."""
    ex = make_executor(tiny_checkpoint("llama"), decode_kernel="native", dtype=dtype)
    prompts = [prompt_of(n, seed=n) for n in (7, 19, 33, 4, 12)]
    starts = [ex.prefill(p, output=LOGITS) for p in prompts]
    items = [DecodeItem(CacheRef(r.cache.cache_id, r.cache.seq_len), r.output.tokens[0].token_id, output=LOGITS)
             for r in starts]
    alone = [ex.decode([it])[0].output.logits for it in items]
    for group in (items[:3], items):
        # the same positions again: truncate back one token first (the step rewrites the same slots)
        for it in group:
            ex.truncate_cache(it.cache.cache_id, it.cache.seq_len)
        out = ex.decode(group)
        for i, r in enumerate(out):
            assert torch.equal(r.output.logits, alone[i])
    ex.release_cache([r.cache.cache_id for r in starts])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_bfloat16_model_runs_natively_near_float32(tiny_checkpoint, arch):
    """--dtype bfloat16: bfloat16 weights, embedding and K/V read in place, float32 activations inside the
    step. On a bfloat16 checkpoint (float32 holds its weights exactly) and float32's greedy tokens, every
    decode step's logits are within bfloat16's noise of float32's (the eager bfloat16 step's own: measured
    1-4%, the prefill's KV included), with the same argmax wherever the eager bfloat16 step has it."""
    model_dir = tiny_checkpoint(arch, dtype="bfloat16")
    prompt = prompt_of(21, seed=1)
    _, tokens, ref = greedy_run(make_executor(model_dir, decode_kernel="native"), prompt, STEPS)
    native = make_executor(model_dir, dtype="bfloat16", decode_kernel="native")
    eager = make_executor(model_dir, dtype="bfloat16", decode_kernel="torch")
    got, base = teacher_forced_logits(native, prompt, tokens), teacher_forced_logits(eager, prompt, tokens)
    assert native.decode_step.calls == STEPS - 1 and "native_decode" in native.info().capabilities
    err = max(rel_err(a, r) for a, r in zip(got[1:], ref[1:]))
    assert err < 0.06 and err <= max(rel_err(a, r) for a, r in zip(base[1:], ref[1:])) + 0.01
    agreed = sum(int(a.argmax() == r.argmax()) for a, r in zip(got, ref))
    assert agreed >= sum(int(a.argmax() == r.argmax()) for a, r in zip(base, ref)) and agreed >= STEPS - 1
    assert native.kv_usage().free_blocks == native.kv_usage().total_blocks


@pytest.fixture(scope="module")
def lora(tiny_checkpoint, tmp_path_factory) -> LoraSetup:
    return LoraSetup(tiny_checkpoint("llama"), tmp_path_factory.mktemp("lora-native"), ADAPTERS)


def test_lora_items_run_eager_beside_native_base_steps(lora):
    ex = lora.executor(preload=("qv4", "mlp16"), decode_kernel="native")
    seqs = [("", 9), ("qv4", 17), ("mlp16", 5)]
    prompts = [prompt_of(n, seed=40 + i) for i, (_, n) in enumerate(seqs)]
    gen, logits = mixed_batch_run(ex, prompts, 16, release_after={1: 6, 2: 8}, adapters=[a for a, _ in seqs])
    assert ex.decode_step.calls > 0  # the base sequence's steps alone, once the adapters' sequences were released
    for i, (adapter, _) in enumerate(seqs):
        ref_tokens, ref_logits = lora.greedy(adapter, prompts[i], len(gen[i]))
        assert gen[i] == ref_tokens, f"sequence {i} ({adapter or 'base'})"
        for a, b in zip(logits[i], ref_logits):
            assert rel_err(a, b) < TOL


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_quantized_weights_match_the_eager_step_on_the_same_weights(tiny_checkpoint, mode):
    """The native step reads the FBGEMM path's own weights (float16; int8 + per-row scales) with float32
    activations for fp16 (as the eager FBGEMM step does), ~15-bit activations for int8 (two int8 digits), where
    the eager int8 GEMM rounds them to ~14 bits (models/quant/linear.py): hence 3e-3 there. (Against the
    weight-only dequantizing kernel the native int8 step agrees to 1e-3:
    test_the_descriptors_follow_weights_changed_in_place.)"""
    model_dir = tiny_checkpoint("qwen2")
    ex = make_executor(model_dir, quantization=mode, decode_kernel="native")
    ref = make_executor(model_dir, quantization=mode, decode_kernel="torch")
    prompt = prompt_of(15, seed=3)
    _, tokens, logits = greedy_run(ref, prompt, 10)
    _, got_tokens, got = greedy_run(ex, prompt, 10)
    assert ex.decode_step.calls >= 9 and got_tokens == tokens
    assert max(rel_err(a, b) for a, b in zip(got, logits)) < (2e-3 if mode == "fp16" else 3e-3)


def test_the_descriptors_follow_weights_changed_in_place(tiny_checkpoint):
    """Weights quantized after the executor started (as tests of the portable int8 kernel do): the native
    step reads the new weights, not the float ones it first described."""
    model_dir = tiny_checkpoint("llama")
    ex = make_executor(model_dir, cpu_packed_weights=False, decode_kernel="native")
    eager = make_executor(model_dir, cpu_packed_weights=False, decode_kernel="torch")
    for e in (ex, eager):
        e.model.quantize("int8", force_dequant=True)
    prompt = prompt_of(9, seed=4)
    want, got = greedy_run(eager, prompt, 6)[2], greedy_run(ex, prompt, 6)[2]
    # the same int8 weights; the native step's activations are ~15-bit (two int8 digits), the eager ones float32
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-3


def test_a_failed_native_step_changes_nothing(tiny_checkpoint, monkeypatch):
    """The op failing (its scratch allocation raises torch.OutOfMemoryError; injected here) fails the call with
    RESOURCE_EXHAUSTED's error and leaves every cache and the pool as they were; the next step runs."""
    from tandem.errors import DeviceOutOfMemory
    ex = make_executor(tiny_checkpoint("llama"), decode_kernel="native")
    results = [ex.prefill(prompt_of(n, seed=n), output=LOGITS) for n in (12, 16)]  # 16: the next token needs a block
    usage = ex.kv_usage()
    items = [DecodeItem(CacheRef(r.cache.cache_id, r.cache.seq_len), r.output.tokens[0].token_id, output=LOGITS)
             for r in results]

    def failing(*args):
        raise torch.OutOfMemoryError("the native decode step could not allocate its scratch memory")

    monkeypatch.setattr(ex.decode_step, "step", failing)
    with pytest.raises(DeviceOutOfMemory):
        ex.decode(items)
    assert ex.kv_usage() == usage
    assert [ex.cache_length(r.cache.cache_id) for r in results] == [12, 16]
    monkeypatch.undo()
    assert [d.cache.seq_len for d in ex.decode(items)] == [13, 17]
    ex.release_cache([r.cache.cache_id for r in results])


def test_the_op_checks_what_it_is_given(tiny_checkpoint):
    """torch.ops.tandem.decode_step and tandem.DecodeModel: the dispatcher checks argument types against the
    schema, the C++ side each tensor's dtype, shape and layout and every index it would read through (token
    ids, positions, block ids), naming what is wrong, before the step touches anything."""
    ex = make_executor(tiny_checkpoint("qwen3"), decode_kernel="native")
    step = ex.decode_step
    desc, vocab, d = step._describe(), ex.model.config.vocab_size, ex.model.config.head_dim
    ids, pos, table = torch.tensor([5, 7]), torch.tensor([0, 3]), torch.tensor([[1], [2]])
    cos = sin = torch.zeros(2, d)
    pool = ex.kv.k.clone()
    assert step.step(desc, ids, pos, table, cos, sin).shape == (2, vocab)  # (blocks 1 and 2 are free here)
    op = torch.ops.tandem.decode_step
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor'"):
        op(desc, [5, 7], pos, table, cos, sin)  # the dispatcher: not a tensor
    bad = [((ids.int(), pos, table, cos, sin), TypeError, "token_ids must be Long, not Int"),
           ((ids, pos, table, cos.double(), sin), TypeError, "cos must be Float, not Double"),
           ((ids, pos, table, cos[:, :8], sin), ValueError, rf"cos must have shape \[2, {d}\], not \[2, 8\]"),
           ((ids, pos, torch.tensor([[1, 2], [0, 0]]).t(), cos, sin), ValueError, "block_tables must be contiguous"),
           ((torch.tensor([5, vocab]), pos, table, cos, sin), ValueError, f"token ids must be in \\[0, {vocab}\\)"),
           ((ids, torch.tensor([0, 4 * ex.kv.block_size]), table, cos, sin), ValueError, "not covered by its block"),
           ((ids, pos, torch.tensor([[1], [ex.kv.num_blocks]]), cos, sin), ValueError, "names block")]
    ex.kv.k.copy_(pool)
    for args, error, message in bad:
        with pytest.raises(error, match=message):
            op(desc, *args)
        assert torch.equal(ex.kv.k, pool)  # refused before anything was written
    cfg = ex.model.config
    with pytest.raises(TypeError, match="v_cache must be Float, not BFloat16"):
        torch.classes.tandem.DecodeModel(ex.model.model.embed_tokens.weight, 0, ex.model.model.norm.weight, [], [],
                                         [], [], [], [], [], ex.kv.k, ex.kv.v.bfloat16(), cfg.num_heads, 1e-6, 1.0)
    with pytest.raises(ValueError, match="parts: one per linear \\(5 per layer"):
        torch.classes.tandem.DecodeModel(ex.model.model.embed_tokens.weight, 0, ex.model.model.norm.weight, [], [],
                                         [], [], [], [], [], ex.kv.k, ex.kv.v, cfg.num_heads, 1e-6, 1.0)


def test_kernel_choice_and_refusals(tiny_checkpoint):
    llama, moe = tiny_checkpoint("llama"), tiny_checkpoint("qwen3_moe")
    auto = make_executor(moe)  # MoE: auto falls back to the PyTorch step
    assert auto.decode_step is None
    with pytest.raises(ValueError, match="--decode-kernel native: the native step cannot run here: MoE"):
        make_executor(moe, decode_kernel="native")
    with pytest.raises(ValueError, match="does not combine"):
        choose_decode(ExecutorConfig(llama, compile=True, decode_kernel="native"), auto.model, auto.kv)
    with pytest.raises(ValueError, match="unknown --decode-kernel"):
        make_executor(llama, decode_kernel="fast")
    assert isinstance(make_executor(llama).decode_step, NativeDecode)  # auto picks native where it can run
    assert isinstance(make_executor(llama, dtype="bfloat16").decode_step, NativeDecode)
    with pytest.raises(ValueError, match="runs --dtype float32 or bfloat16 models, not float16"):
        make_executor(llama, dtype="float16", decode_kernel="native")
    with pytest.raises(ValueError, match="--quantization needs --dtype float32"):
        make_executor(llama, dtype="bfloat16", quantization="fp16", decode_kernel="native")


def test_the_library_is_built_once_per_cache_dir(tmp_path):
    """The library is built into the cache once per (sources, compiler, torch, flags) and reused after that; a
    build that fails says so; the process keeps the one library it loaded."""
    first = build_library()  # (the tests above built it into the default cache)
    stamp = first.stat().st_mtime_ns
    assert build_library(NativeBuild()) == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert load_kernel() == load_kernel(NativeBuild()) and hasattr(torch.ops.tandem, "decode_step")
    with pytest.raises(RuntimeError, match="building the native decode step failed"):
        build_library(NativeBuild(tmp_path, cxx="/bin/false"))  # a compiler that fails
    assert not list(tmp_path.glob("*.so"))


def test_no_compiler_or_a_failed_build_falls_back_under_auto(tiny_checkpoint, caplog, tmp_path):
    """No compiler (a path that is not there): native_refusal says so, auto runs the PyTorch step and
    --decode-kernel native is refused with the reason. A compiler that fails: the same, from the build."""
    model_dir = tiny_checkpoint("llama")
    ex = make_executor(model_dir, decode_kernel="torch")
    missing = NativeBuild(tmp_path, cxx=str(tmp_path / "no-such-g++"))
    assert native_refusal(ex.model, ex.kv, missing) == f"no C++ compiler ({missing.cxx}) on the PATH to build it"
    failing = NativeBuild(tmp_path, cxx="/bin/false")
    for build, logged in ((missing, "the native kernel does not apply: no C++ compiler"),
                          (failing, "could not be built or loaded")):
        caplog.clear()
        with caplog.at_level("INFO", logger="tandem.executor"):
            assert choose_decode(ExecutorConfig(model_dir), ex.model, ex.kv, build=build).step is None
        assert logged in caplog.text
    with pytest.raises(ValueError, match=r"native step cannot run here: no C\+\+ compiler"):
        choose_decode(ExecutorConfig(model_dir, decode_kernel="native"), ex.model, ex.kv, build=missing)
    with pytest.raises(ValueError, match="--decode-kernel native: the native kernel could not be built or loaded: "
                                         "building the native decode step failed"):
        choose_decode(ExecutorConfig(model_dir, decode_kernel="native"), ex.model, ex.kv, build=failing)


def test_real_executor_process_serves_native_steps(tiny_checkpoint):
    """`python -m executor_service --decode-kernel native` (a real process): GetInfo lists native_decode and
    a greedy run through Decode matches transformers — with a bad item (a token id past the vocabulary, then
    a wrong position) beside it in every call: each bad item fails alone, the good one is unaffected, and
    after the release the pool is whole (nothing leaked). On a MoE model the flag exits 2 with the reason."""
    from executor_service.rpc import codec
    from tandem.executor.v1 import executor_pb2 as pb
    from tests.grpc_harness import start_executor
    model_dir = tiny_checkpoint("qwen3")
    prompt = prompt_of(13, seed=8)
    ref_tokens, ref_logits = HfReference(model_dir).greedy(prompt, 8)
    logits_mode = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
    with start_executor(model_dir, "--decode-kernel", "native", "--no-prefix-caching") as server:
        info = server.stub.GetInfo(pb.GetInfoRequest())
        assert "native_decode" in info.capabilities
        first = server.stub.Prefill(pb.PrefillRequest(token_ids=prompt, output=logits_mode))
        tokens, cache = [first.output.tokens[0].token_id], first.cache
        got = [codec.decode_logits(first.output.logits).reshape(-1)]
        for step in range(7):
            good = pb.DecodeItem(cache=cache, token_id=tokens[-1], output=logits_mode)
            bad = (pb.DecodeItem(cache=cache, token_id=info.vocab_size + 5) if step % 2 else
                   pb.DecodeItem(cache=pb.CacheRef(cache_id=cache.cache_id, seq_len=cache.seq_len + 3),
                                 token_id=tokens[-1]))
            r, failed = server.stub.Decode(pb.DecodeRequest(items=[good, bad])).results
            assert r.status.code == 0 and failed.status.code != 0, failed.status.message
            tokens.append(r.output.tokens[0].token_id)
            got.append(codec.decode_logits(r.output.logits).reshape(-1))
            cache = r.cache
        server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cache.cache_id]))
        kv = server.stub.GetInfo(pb.GetInfoRequest()).kv
        assert kv.free_blocks == kv.total_blocks and kv.active_caches == 0
    assert tokens == ref_tokens
    assert max(rel_err(torch.from_numpy(a.copy()), b) for a, b in zip(got, ref_logits)) < TOL
    done = server_process.run_to_exit("executor_service", "--model", str(tiny_checkpoint("qwen3_moe")),
                                      "--decode-kernel", "native", "--port", "0", timeout=120)
    assert done.returncode == 2 and "MoE layers are not in the native step" in done.stderr
    # an executor whose compiler ($CXX of its environment) is not there: the flag exits 2 saying so
    done = subprocess.run([sys.executable, "-m", "executor_service", "--model", str(model_dir), "--decode-kernel",
                           "native", "--port", "0"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CXX="/nonexistent/g++"))
    assert done.returncode == 2 and "no C++ compiler (/nonexistent/g++)" in done.stderr
