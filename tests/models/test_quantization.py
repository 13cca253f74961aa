"""Low-precision linear weights (models/quant/linear.py, executor --quantization): the kernels compute what
they claim, the float copies are dropped, every batch shape and LoRA still run, and bad modes are refused.
Quality on the real model (greedy agreement, NLL) is tests/executor/test_quantization_quality.py."""
from __future__ import annotations

import pytest
import torch

from executor_service.__main__ import parse_args
from executor_service.rpc.codec import info_to_pb
from models.decode.native import NativeDecode
from models.quant.linear import Fp16Weight, Int8Weight, fbgemm_usable, quantize_per_channel
from models.moe import SparseMoeBlock
from models.transformer import Linear
from tests.executor_driver import greedy_run, make_executor, mixed_batch_run, teacher_forced_logits
from tests.hf_reference import rel_err

PROMPT = [1] + list(range(5, 45))
needs_fbgemm = pytest.mark.skipif(not fbgemm_usable("int8"), reason="torch built without FBGEMM (x86 only)")


def test_per_channel_int8_round_trip_is_within_half_a_step():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 48)[:, None]
    w[5] = 0  # an all-zero row keeps a finite scale and stays zero
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (48,) and int(q.abs().max()) == 127
    assert torch.all((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7)
    assert not q[5].any()


@pytest.mark.parametrize("kernel", [pytest.param("fbgemm", marks=needs_fbgemm), "dequant", "fp16"])
def test_layer_kernels_match_the_float_product(kernel):
    if kernel == "fp16" and not fbgemm_usable("fp16"):
        pytest.skip("torch built without FBGEMM (x86 only)")
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(96, 256, generator=g), torch.randn(96, generator=g), torch.randn(9, 256, generator=g)
    layer = Fp16Weight(w, b) if kernel == "fp16" else Int8Weight(w, b, use_fbgemm=kernel == "fbgemm")
    got, want = layer(x), x @ w.T + b
    assert got.shape == (9, 96) and got.dtype == torch.float32
    if kernel == "fp16":
        assert rel_err(got, want) < 2e-3  # float16 weights: ~1e-3 relative
        return
    assert rel_err(got, want) < 1e-2  # int8 weights: half a step of absmax/127 each
    q, scales = quantize_per_channel(w)
    exact = x @ (q.float() * scales[:, None]).T + b  # what the int8 weights give in exact arithmetic
    # fbgemm: activations on ~14 bits per row (two 7-bit passes), vs the dequant kernel's float32.
    assert rel_err(got, exact) < (1e-3 if kernel == "fbgemm" else 1e-5)


@needs_fbgemm
def test_fbgemm_rows_do_not_depend_on_their_neighbours():
    """Per-row activation scales: a row computed alone or beside rows 1000x larger gives the same bits."""
    g = torch.Generator().manual_seed(2)
    layer = Int8Weight(torch.randn(64, 128, generator=g), torch.randn(64, generator=g), use_fbgemm=True)
    x = torch.randn(5, 128, generator=g)
    x[1] *= 1000
    x[3] -= 50
    batch = layer(x)
    for i in range(5):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])


@pytest.mark.parametrize("mode,force_dequant", [pytest.param("int8", False, marks=needs_fbgemm), ("int8", True),
                                                 ("fp16", False)])
def test_quantized_executor_stays_close_to_float32(tiny_checkpoint, mode, force_dequant):
    if mode == "fp16" and not fbgemm_usable("fp16"):
        pytest.skip("torch built without FBGEMM (x86 only)")
    model = tiny_checkpoint("llama")
    ref = make_executor(model)
    ex = make_executor(model, quantization=mode)
    if force_dequant:  # the portable kernel (CUDA's) on this CPU
        ex = make_executor(model, cpu_packed_weights=False)
        assert ex.model.quantize("int8", force_dequant=True) == "dequant-int8"
    else:
        # int8 where the native step runs decode: its plain weights (read in place), dequantized in eager calls
        plain = mode == "int8" and isinstance(ex.decode_step, NativeDecode)
        assert ex.quantization_kernel == ("dequant-int8" if plain else {"int8": "fbgemm-int8", "fp16": "fbgemm-fp16"}[mode])
    linears = [m for m in ex.model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None and m.packed is None for m in linears)  # no oneDNN copy on top
    tied = ex.model.config.tie_word_embeddings
    assert all(m.weight.numel() == 0 for m in linears if not (tied and m is ex.model.lm_head))  # floats dropped
    _, tokens_ref, logits_ref = greedy_run(ref, PROMPT, 8)
    logits = teacher_forced_logits(ex, PROMPT, tokens_ref)  # the same tokens fed, whatever int8 would pick
    errors = [rel_err(a, b) for a, b in zip(logits, logits_ref)]
    assert max(errors) < (2e-3 if mode == "fp16" else 5e-2), errors
    if mode == "fp16":
        assert greedy_run(ex, PROMPT, 8)[1] == tokens_ref


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["int8", "fp16"])
def test_other_architectures_quantize(tiny_checkpoint, arch, mode):
    """Qwen2's q/k/v biases, Qwen3's q/k norms, Qwen3-MoE (its router stays float32: a flipped expert choice
    is not a rounding error; the fused expert tensors are not Linear layers and stay float32 too). fp16 is
    compared with float32; int8's FBGEMM path with the portable kernel on the same int8 weights (random tiny
    weights lose several % of the logits' range to int8 itself; its quality is measured on SmolLM2)."""
    if not fbgemm_usable(mode):
        pytest.skip("torch built without FBGEMM (x86 only)")
    model = tiny_checkpoint(arch)
    ex = make_executor(model, quantization=mode)
    if mode == "fp16":
        ref = make_executor(model)
    else:
        ref = make_executor(model, cpu_packed_weights=False)
        ref.model.quantize("int8", force_dequant=True)
    assert isinstance(ex.model.model.layers[0].mlp, SparseMoeBlock) == (arch == "qwen3_moe")
    assert info_to_pb(ex.info()).quantization == mode and info_to_pb(ref.info()).quantization == "none"  # GetInfo
    _, tokens_ref, logits_ref = greedy_run(ref, PROMPT, 6)
    errors = [rel_err(a, b) for a, b in zip(teacher_forced_logits(ex, PROMPT, tokens_ref), logits_ref)]
    assert max(errors) < 2e-3, errors


@needs_fbgemm
def test_quantized_mixed_batches_chunks_and_lora_run(tiny_checkpoint, tmp_path):
    """Chunked prefill beside decodes, and LoRA on top of int8 base weights, against the same int8 executor
    computing each sequence alone: activation scales are per row, so batching changes nothing but the float
    summation order in attention, which the ~14-bit activation rounding may turn into ~1e-4 (the per-call scale of the plain op: 0.12)."""
    from tests.lora_fixtures import make_peft_adapter

    model = tiny_checkpoint("llama")
    adapter = make_peft_adapter(model, tmp_path / "ad", r=4, alpha=8, seed=3)
    ex = make_executor(model, quantization="int8", adapters=(("a", adapter),))
    prompts = [PROMPT, [1] + list(range(60, 83)), [1] + list(range(90, 101))]
    tokens, logits = mixed_batch_run(ex, prompts, steps=6, adapters=["", "a", ""])
    assert all(len(t) == 6 for t in tokens)
    usage = ex.kv_usage()
    assert usage.free_blocks == usage.total_blocks  # everything released, nothing leaked
    for i, (p, a) in enumerate(zip(prompts, ["", "a", ""])):
        cache_id, alone, alone_logits = greedy_run(ex, p, 6, adapter=a)
        ex.release_cache([cache_id])
        assert alone == tokens[i]
        assert max(rel_err(a, b) for a, b in zip(logits[i], alone_logits)) < 1e-3


def test_unknown_mode_and_cli_choices_are_refused(tiny_checkpoint):
    ex = make_executor(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        ex.model.quantize("int3")
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--quantization", "int3"])
    assert parse_args(["--model", "m", "--quantization", "int8"]).quantization == "int8"
    assert parse_args(["--model", "m", "--quantization", "int4"]).quantization == "int4"
    assert parse_args(["--model", "m"]).quantization == "none"
