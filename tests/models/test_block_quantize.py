"""Block quantizers (models/quant/block_quantize.py): byte for byte the `gguf` package's port of ggml's reference
quantizers, on random rows and on the edge cases of their arithmetic (all-zero blocks, ties of the largest
magnitude, one outlier, all-negative, constant and tiny blocks); refusals name what is wrong."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.quant.block_formats import FORMATS, dequantize_reference
from models.quant.block_quantize import QUANTIZABLE, quantize_blocks

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def _edge_rows() -> torch.Tensor:
    """[16, 96] float32: random rows, then rows whose first block is one of the edge cases."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 96, generator=g)
    w[0, :32] = 0.0  # all zero: d = 0 (q from the 0 inverse)
    w[1, :32] = 1.0  # constant
    w[2, 5] = 100.0  # one outlier
    w[3, :32] = -w[3, :32].abs()  # all negative: the signed maximum is negative
    w[4, :16], w[4, 16:32] = -3.0, 3.0  # equal magnitudes of both signs: the first one wins
    w[5, :32] *= 1e-6  # tiny: float16 d goes subnormal
    w[6, :32] *= 1e4  # large: float16 d and m near the top of their range
    w[7] = torch.linspace(-1, 1, 96)  # exact ties at .5 after scaling
    return w


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_bytes_equal_ggml_reference(name):
    fmt = FORMATS[name]
    for w in (_edge_rows(), torch.randn(7, 256, generator=torch.Generator().manual_seed(1)) * 0.02):
        ours = quantize_blocks(w, fmt)
        assert ours.dtype == torch.uint8 and tuple(ours.shape) == (w.shape[0], fmt.row_bytes(w.shape[1]))
        ref = gguf_quants.quantize(w.numpy(), GGMLQuantizationType(fmt.ggml_type))
        np.testing.assert_array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_slices_and_dtypes_give_the_same_bytes(name, monkeypatch):
    """The row slicing inside quantize_blocks changes nothing; a bfloat16 weight quantizes as its float32 value."""
    import models.quant.block_quantize as bq

    fmt = FORMATS[name]
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = quantize_blocks(w, fmt)
    monkeypatch.setattr(bq, "CHUNK", 128 * 5)  # 5 rows per slice, the last one short
    assert torch.equal(quantize_blocks(w, fmt), whole)
    assert torch.equal(quantize_blocks(w.float(), fmt), whole)


@pytest.mark.parametrize("name, bound", [("Q8_0", 0.01), ("Q5_0", 0.06), ("Q5_1", 0.05), ("Q4_0", 0.12),
                                         ("Q4_1", 0.1)])
def test_round_trip_error_is_that_of_the_format(name, bound):
    """Dequantized by the reference dequantizer: the mean error relative to the mean magnitude, as measured
    for Gaussian weights (Q4_0 0.090, Q4_1 0.081, Q5_0 0.045, Q8_0 0.005)."""
    fmt = FORMATS[name]
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    back = torch.from_numpy(dequantize_reference(quantize_blocks(w, fmt).numpy(), fmt, 512))
    assert float((back - w).abs().mean() / w.abs().mean()) < bound


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="no quantizer for Q4_K"):
        quantize_blocks(torch.zeros(2, 256), FORMATS["Q4_K"])
    with pytest.raises(ValueError, match=r"multiple of 32, not \(2, 48\)"):
        quantize_blocks(torch.zeros(2, 48), FORMATS["Q8_0"])
