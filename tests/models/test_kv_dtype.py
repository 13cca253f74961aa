"""--kv-dtype (models/kv_dtype.py): resolution beside the weights' dtype, and the fp8 KV store/load round trip."""
from __future__ import annotations

import pytest
import torch

from models.kv_dtype import FP8_MAX, Fp8Kv, kv_dtype_name, resolve_kv_dtype


def test_resolution():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="use --kv-dtype auto"):
        resolve_kv_dtype("fp8_e4m3", torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_kv_dtype("int4", torch.float32)
    assert kv_dtype_name(torch.float8_e4m3fn) == "fp8_e4m3" and kv_dtype_name(torch.bfloat16) == "bfloat16"


def test_fp8_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 16, generator=g) * 10
    pool = Fp8Kv((4, 4, 2, 16), torch.device("cpu"), Fp8Kv.scale_for(x))
    slots = torch.tensor([3, 7, 0, 15, 9, 12])
    pool.store(slots, x)
    y = pool.load(slots, torch.float32)
    # e4m3: 3 mantissa bits, half an ulp = 1/16 relative (normal range; the scale keeps the values there)
    big = x.abs() > 1e-2 * float(x.abs().max())
    assert ((y - x).abs()[big] / x.abs()[big]).max() <= 1 / 16 + 1e-6
    assert float((y - x).abs().max()) <= float(x.abs().max()) / 16
    untouched = pool.load(torch.tensor([1, 2]), torch.float32)
    assert not untouched.any()  # other slots stay zero
    pool.store(torch.tensor([1]), torch.full((1, 2, 16), 1e9))  # past the range: saturated, never NaN
    assert torch.isfinite(pool.load(torch.tensor([1]), torch.float32)).all()
    assert float(pool.load(torch.tensor([1]), torch.float32).max()) == pytest.approx(FP8_MAX * float(pool.scale))
