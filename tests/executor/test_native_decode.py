"""The native decode kernel (`--decode-kernel native`, models/native_decode.py) against transformers and the
PyTorch step: greedy runs on every dense architecture (Qwen2's biases, Qwen3's q/k norms), mixed batches with
chunks and releases, LoRA beside native base steps, quantized weights, batch invariance, a failed step that
changes nothing, the choice of kernel (auto / native / torch / --compile) and its refusals, the library's
build cache, and a real executor process.

`auto` is the default, so the rest of the suite runs its decode steps natively too wherever it can; the
eager step (`--decode-kernel torch`) is checked against transformers here.
"""
from __future__ import annotations

import ctypes
import random
import subprocess
import sys

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.decode_kernel import choose_decode_step
from executor_service.types import CacheRef, DecodeItem
from models.native_decode import ABI_VERSION, NativeDecode, build_library, machine_refusal
from tests.executor.test_lora_parity import ADAPTERS, Setup as LoraSetup
from tests.executor_driver import (LOGITS, assert_greedy_matches, greedy_run, make_executor, mixed_batch_run,
                                   teacher_forced_logits)
from tests.hf_reference import HfReference, rel_err

TOL = 1e-4
STEPS = 24

# Everything but the choice/refusal test needs the kernel: an x86-64 CPU with AVX2/FMA/F16C and g++.
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
    assert_greedy_matches(ex, prompt, ref_tokens, ref_logits, STEPS, TOL)
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
    the eager int8 GEMM rounds them to ~14 bits (models/quantization.py): hence 3e-3 there. (Against the
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
    """The C++ step reporting a failure (its scratch allocation, injected here) fails the call with
    RESOURCE_EXHAUSTED's error and leaves every cache and the pool as they were; the next step runs."""
    from tandem.errors import DeviceOutOfMemory
    ex = make_executor(tiny_checkpoint("llama"), decode_kernel="native")
    results = [ex.prefill(prompt_of(n, seed=n), output=LOGITS) for n in (12, 16)]  # 16: the next token needs a block
    usage = ex.kv_usage()
    items = [DecodeItem(CacheRef(r.cache.cache_id, r.cache.seq_len), r.output.tokens[0].token_id, output=LOGITS)
             for r in results]

    class Failing:
        def __init__(self, lib):
            self.lib = lib

        def tandem_decode_step(self, *args):
            return 1

    monkeypatch.setattr(ex.decode_step, "lib", Failing(ex.decode_step.lib))
    with pytest.raises(DeviceOutOfMemory):
        ex.decode(items)
    assert ex.kv_usage() == usage
    assert [ex.cache_length(r.cache.cache_id) for r in results] == [12, 16]
    monkeypatch.undo()
    assert [d.cache.seq_len for d in ex.decode(items)] == [13, 17]
    ex.release_cache([r.cache.cache_id for r in results])


def test_kernel_choice_and_refusals(tiny_checkpoint):
    llama, moe = tiny_checkpoint("llama"), tiny_checkpoint("qwen3_moe")
    auto = make_executor(moe)  # MoE: auto falls back to the PyTorch step
    assert auto.decode_step is None
    with pytest.raises(ValueError, match="native cannot run here: MoE"):
        make_executor(moe, decode_kernel="native")
    with pytest.raises(ValueError, match="does not combine"):
        choose_decode_step(ExecutorConfig(llama, compile=True, decode_kernel="native"), auto.model, auto.kv)
    with pytest.raises(ValueError, match="unknown --decode-kernel"):
        make_executor(llama, decode_kernel="fast")
    assert isinstance(make_executor(llama).decode_step, NativeDecode)  # auto picks native where it can run
    assert isinstance(make_executor(llama, dtype="bfloat16").decode_step, NativeDecode)
    with pytest.raises(ValueError, match="runs --dtype float32 or bfloat16 models, not float16"):
        make_executor(llama, dtype="float16", decode_kernel="native")
    with pytest.raises(ValueError, match="--quantization needs --dtype float32"):
        make_executor(llama, dtype="bfloat16", quantization="fp16", decode_kernel="native")


def test_the_library_is_built_once_per_cache_dir(tmp_path, monkeypatch):
    first = build_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert ctypes.CDLL(str(first)).tandem_abi_version() == ABI_VERSION
    monkeypatch.setattr("models.native_decode.compiler", lambda: "/bin/false")
    with pytest.raises(RuntimeError, match="compiling the native decode step failed"):
        build_library(tmp_path / "other")


def test_a_compiler_failure_falls_back_under_auto(tiny_checkpoint, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr("models.native_decode.compiler", lambda: "/bin/false")
    model_dir = tiny_checkpoint("llama")
    ex = make_executor(model_dir, decode_kernel="torch")
    with caplog.at_level("WARNING", logger="tandem.executor"):
        step = choose_decode_step(ExecutorConfig(model_dir, native_cache_dir=tmp_path), ex.model, ex.kv)
    assert step is None and "could not be built" in caplog.text
    with pytest.raises(ValueError, match="--decode-kernel native"):
        choose_decode_step(ExecutorConfig(model_dir, decode_kernel="native", native_cache_dir=tmp_path),
                           ex.model, ex.kv)


def test_real_executor_process_serves_native_steps(tiny_checkpoint):
    """`python -m executor_service --decode-kernel native` (a real process): GetInfo lists native_decode and
    a greedy run through Decode matches transformers — with a bad item (a token id past the vocabulary, then
    a wrong position) beside it in every call: each bad item fails alone, the good one is unaffected, and
    after the release the pool is whole (nothing leaked). On a MoE model the flag exits 2 with the reason."""
    from executor_service import codec
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
    done = subprocess.run([sys.executable, "-m", "executor_service", "--model", str(tiny_checkpoint("qwen3_moe")),
                           "--decode-kernel", "native", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "MoE layers are not in the native step" in done.stderr
