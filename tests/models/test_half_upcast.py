"""Half-precision linears on a CPU without oneDNN's bf16/fp16 support (models/half_upcast.py): calls of many
rows multiply in float32 from the half weights, a slice at a time through one scratch buffer. The product
equals the float32 one up to the final rounding, sliced or not, with and without bias; a bf16 model turns it
on exactly where oneDNN lacks bf16 (never for float32, never on quantized layers); a prefill through it
stays as close to transformers as torch's half GEMM does, with the same greedy token."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_service.types import OutputMode, OutputOptions
from models.half_upcast import MIN_ROWS, HalfUpcast, onednn_lacks
from models.transformer import Linear
from tests.executor.test_executor_parity import prompt_of
from tests.executor_driver import make_executor
from tests.hf_reference import HfReference, rel_err

LOGITS = OutputOptions(mode=OutputMode.LOGITS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scratch", [1 << 20, 96 * 64, 96 * 7])  # one slice; 5 slices; 43 slices (last 6 rows)
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_product_is_the_float32_one(dtype, scratch, with_bias):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=g).to(dtype)
    w = (torch.randn(300, 96, generator=g) / 10).to(dtype)
    b = torch.randn(300, generator=g).to(dtype) if with_bias else None
    got = HalfUpcast(scratch_elements=scratch).linear(x, w, b)
    want = (x.double() @ w.double().T + (0 if b is None else b.double())).to(dtype)  # rounded once
    assert got.dtype == dtype and got.shape == (40, 300)
    ulp = torch.finfo(dtype).eps  # float32 accumulation may flip the final rounding by one unit
    assert torch.allclose(got.double(), want.double(), rtol=ulp, atol=ulp)


def upcasts(ex) -> set:
    return {id(m.upcast) if m.upcast is not None else None for m in ex.model.modules() if isinstance(m, Linear)}


def test_on_exactly_where_onednn_lacks_the_half_type(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2")  # q/k/v biases
    half = make_executor(model_dir, dtype="bfloat16")
    if onednn_lacks(torch.bfloat16):
        assert len(upcasts(half)) == 1 and None not in upcasts(half)  # one scratch buffer for every layer
    else:
        assert upcasts(half) == {None}
    assert upcasts(make_executor(model_dir, dtype="float32")) == {None}
    quantized = make_executor(model_dir, dtype="float32", quantization="int8")
    assert quantized.model.upcast_cpu_half_linears() is False and upcasts(quantized) == {None}


def prefill_logits(ex, prompt: list[int]) -> torch.Tensor:
    res = ex.prefill(prompt, output=LOGITS)
    ex.release_cache([res.cache.cache_id])
    return res.output.logits[0]


def test_a_prefill_through_it_stays_close_to_transformers(tiny_checkpoint, monkeypatch):
    """Forced on (whatever this CPU has): a 48-token prefill takes the float32 product in every linear but
    the LM head (one row), and lands where torch's bf16 GEMM and transformers in bfloat16 do."""
    model_dir = tiny_checkpoint("qwen2")
    ex = make_executor(model_dir, dtype="bfloat16")
    linears = [m for m in ex.model.modules() if isinstance(m, Linear)]
    prompt = prompt_of(48, seed=4)
    assert len(prompt) >= MIN_ROWS
    for m in linears:
        m.upcast = None
    half_gemm = prefill_logits(ex, prompt)

    upcast, calls = HalfUpcast(), []
    real = upcast.linear
    monkeypatch.setattr(upcast, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in linears:
        m.upcast = upcast
    got = prefill_logits(ex, prompt)
    assert calls and set(calls) == {len(prompt)}
    assert len(calls) == len(linears) - 1  # the LM head ran on the last row only

    ref16 = HfReference(model_dir, dtype=torch.bfloat16).last_logits(prompt)
    # (measured: equal to torch's bf16 GEMM and to transformers in bf16, which also accumulate in float32)
    assert rel_err(got, half_gemm) < 1e-2 and rel_err(got, ref16) < 1e-2
    assert int(got.argmax()) == int(half_gemm.argmax()) == int(ref16.argmax())
