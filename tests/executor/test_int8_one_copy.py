"""--quantization int8 holds its weights once: where the native step runs decode calls (and with --deterministic)
the executor keeps the plain int8 weights, which the step reads in place, instead of FBGEMM's packed copy
beside the step's own (executor_service/step/decode_choice.py keeps_plain_int8); the eager calls dequantize them
a tile at a time. Still the same int8 weights: tokens as the eager FBGEMM executor's, and --deterministic stays
bitwise the same however a prompt is chunked."""
from __future__ import annotations

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.step.decode_choice import keeps_plain_int8
from models.decode.native import NativeDecode, machine_refusal
from models.quant import linear
from models.quant.linear import Int8Weight, fbgemm_usable
from models.transformer import Linear
from tests.executor.test_deterministic_kernels import GREEDY, SEEDED, prompt_of, run
from tests.executor_driver import greedy_run, make_executor
from tests.hf_reference import rel_err

pytestmark = [pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernel: {machine_refusal()}"),
              pytest.mark.skipif(not fbgemm_usable("int8"), reason="FBGEMM kernels (x86 CPU) not in this torch")]


def _int8(ex) -> list[Int8Weight]:
    return [m.quant for m in ex.model.modules() if isinstance(m, Linear)]


def test_the_native_step_reads_the_only_copy(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen2")
    ex = make_executor(model_dir, quantization="int8")  # decode kernel auto: native here
    assert isinstance(ex.decode_step, NativeDecode) and ex.quantization_kernel == "dequant-int8"
    assert all(q._packed is None and q.qweight.dtype == torch.int8 for q in _int8(ex))  # no FBGEMM copy
    mods = [m for m in ex.model.modules() if isinstance(m, Linear)]
    assert not any(ex.decode_step._weights(m)[3] for m in mods)  # read in place: the step copied none
    eager = make_executor(model_dir, quantization="int8", decode_kernel="torch")  # FBGEMM's packed weights
    assert eager.quantization_kernel == "fbgemm-int8"
    prompt = prompt_of(15, seed=3)
    _, want_tokens, want = greedy_run(eager, prompt, 10)
    _, tokens, got = greedy_run(ex, prompt, 10)
    assert ex.decode_step.calls >= 9 and tokens == want_tokens
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 3e-3  # ~14- vs ~15-bit activations, as before


def test_the_tiled_dequantization_equals_the_whole_one(monkeypatch):
    g = torch.Generator().manual_seed(0)
    layer = Int8Weight(torch.randn(100, 64, generator=g), torch.randn(100, generator=g), use_fbgemm=False)
    x = torch.randn(7, 64, generator=g)
    whole = layer(x)
    monkeypatch.setattr(linear, "DEQUANT_TILE", 64 * 30)  # tiles of 30 rows, the last one of 10
    tiled = layer(x)
    assert tiled.is_contiguous() and tiled.shape == (7, 100)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes, plain", [
    ({}, True), ({"deterministic": True}, True), ({"decode_kernel": "torch"}, False), ({"compile": True}, False),
    ({"adapters": (("a", "/nowhere"),)}, False), ({"quantization": "fp16"}, False),
])
def test_which_configurations_keep_plain_int8(tiny_checkpoint, changes, plain):
    """LoRA's decode rows and --decode-kernel torch run the eager forward (FBGEMM's packed weights then)."""
    model = make_executor(tiny_checkpoint("llama")).model
    config = ExecutorConfig(tiny_checkpoint("llama"), **{"quantization": "int8", **changes})
    assert keeps_plain_int8(config, model) is plain


def test_deterministic_int8_is_bitwise_the_same_however_chunked(tiny_checkpoint):
    det = make_executor(tiny_checkpoint("llama"), quantization="int8", deterministic=True)
    assert det.quantization_kernel == "dequant-int8" and all(q._packed is None for q in _int8(det))
    for params in (GREEDY, SEEDED):
        prompt = prompt_of(23, seed=2)
        whole = run(det, prompt, params)
        assert run(det, prompt, params, chunk=3) == whole
        assert run(det, prompt, params, chunk=7, others=2) == whole
