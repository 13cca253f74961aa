"""--quantization int4 (models/quant/linear.py): every linear layer becomes Q4_1 blocks (the LM head Q8_0) in a
BlockWeight, the float copies go, and a layer that does not split into 32-weight blocks is refused before
anything changes. The wiring is checked against BlockWeight's constructor with a stand-in that computes with
the reference dequantizer; the real block kernels (models/quant/blocks.py) are tested where they exist."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from torch import nn

from models.quant.block_formats import FORMATS, dequantize_reference
from models.quant.block_quantize import quantize_blocks
from models.quant.blocks import block_ops_available, q8_activations
from models.quant.linear import INT4_FORMAT, INT4_HEAD_FORMAT, quantize_linears
from models.transformer import Linear
from tests.executor_driver import greedy_run, make_executor, teacher_forced_logits
from tests.hf_reference import rel_err
from tests.prequantized_files import StandInBlockWeight

PROMPT = [1] + list(range(5, 45))


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr("models.quant.linear.BlockWeight", StandInBlockWeight)
    monkeypatch.setattr("models.quant.prequantized.BlockWeight", StandInBlockWeight)
    return StandInBlockWeight


class TwoLayers(nn.Module):
    """A linear layer and an LM head (a stand-in model: quantize_linears only walks its modules)."""

    def __init__(self, inner: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = Linear(64, inner, bias=True)
        self.lm_head = Linear(inner, 96, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def test_layers_get_q4_1_blocks_and_the_head_q8_0(stand_in):
    model = TwoLayers()
    up_w, up_b, head_w = model.up.weight.clone(), model.up.bias.clone(), model.lm_head.weight.clone()
    assert quantize_linears(model, "int4", lambda m: isinstance(m, Linear)) == f"blocks-{INT4_FORMAT}"
    (fmt, blocks), = model.up.quant.parts
    assert fmt is FORMATS["Q4_1"] and torch.equal(blocks, quantize_blocks(up_w, fmt))
    assert model.up.quant.in_features == 64 and torch.equal(model.up.quant.bias, up_b)
    (head_fmt, head_blocks), = model.lm_head.quant.parts
    assert head_fmt is FORMATS[INT4_HEAD_FORMAT] == FORMATS["Q8_0"]
    assert torch.equal(head_blocks, quantize_blocks(head_w, head_fmt))
    assert model.up.weight.numel() == 0 and model.lm_head.weight.numel() == 0  # the float copies dropped
    x = torch.randn(3, 64)
    assert rel_err(model.up(x), (x @ up_w.T + up_b).detach()) < 0.15  # 4-bit weights: ~8% of the output


def test_a_layer_off_the_block_grid_is_refused_untouched(stand_in):
    model = TwoLayers(inner=48)  # lm_head's input, 48, is not a multiple of 32
    with pytest.raises(ValueError, match=r"multiple of 32 \(llama.cpp's blocks\); not lm_head \(48\)"):
        quantize_linears(model, "int4", lambda m: isinstance(m, Linear))
    assert model.up.quant is None and model.up.weight.numel() == 64 * 48  # nothing changed


def test_int4_executor_computes_with_its_blocks(tiny_checkpoint, stand_in):
    """The int4 executor against a float32 one whose weights are the same blocks dequantized: the same logits
    (to float rounding), so every linear layer went through its blocks and nothing else changed. (Against the
    float weights the tiny model's random layers lose ~8% each to 4 bits, compounding to ~50% of the logits'
    range: its quality is the real model's, docs/quantization.md.)"""
    model = tiny_checkpoint("llama")
    ref = make_executor(model, decode_kernel="torch", cpu_packed_weights=False)
    with torch.no_grad():
        for m in ref.model.modules():
            if isinstance(m, Linear):
                fmt = FORMATS[INT4_HEAD_FORMAT if m is ref.model.lm_head else INT4_FORMAT]
                blocks = quantize_blocks(m.weight, fmt).numpy()
                m.weight = nn.Parameter(torch.from_numpy(dequantize_reference(blocks, fmt, m.in_features)),
                                        requires_grad=False)  # (a tied head becomes its own matrix)
    ex = make_executor(model, quantization="int4", decode_kernel="torch")  # (the native step: not yet)
    assert ex.quantization_kernel == "blocks-Q4_1"
    assert all(isinstance(m.quant, StandInBlockWeight) for m in ex.model.modules() if isinstance(m, Linear))
    _, tokens_ref, logits_ref = greedy_run(ref, PROMPT, 6)
    errors = [rel_err(a, b) for a, b in zip(teacher_forced_logits(ex, PROMPT, tokens_ref), logits_ref)]
    assert max(errors) < 1e-4, errors


def test_the_block_kernels_compute_what_the_blocks_hold():
    model = TwoLayers()
    w, b = model.up.weight.clone(), model.up.bias.clone()
    quantize_linears(model, "int4", lambda m: isinstance(m, Linear))
    reference = StandInBlockWeight([(FORMATS[INT4_FORMAT], quantize_blocks(w, FORMATS[INT4_FORMAT]))], 64, b)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    native = block_ops_available()  # (the kernels round activations to 8 bits per block, the fallback does not)
    with torch.no_grad():  # (the stand-in model's bias is a parameter)
        want = reference(q8_activations(x) if native else x)
        np.testing.assert_allclose(model.up(x).numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


def test_off_cpus_int4_is_refused(stand_in):
    with torch.device("meta"):
        model = TwoLayers.__new__(TwoLayers)
        nn.Module.__init__(model)
        model.up, model.lm_head = Linear(64, 64), Linear(64, 96)
    with pytest.raises(ValueError, match="int4 runs on the block kernels, on CPUs; this model is on meta"):
        quantize_linears(model, "int4", lambda m: isinstance(m, Linear))
