"""--kv-dtype (models/kv/dtype.py): resolution beside the weights' dtype, the fp8 KV store/load round trip, and the
attention paths over a pool in another dtype than the activations' (gathered and flex, prefill, chunks after cached
tokens, a prefix hit, decode, draft verify): the two paths agree with each other within float32 noise (they read the
same stored K/V), and with a float32 pool within the dtype's precision. The attention paths run on each device
(tests/devices.py): on CUDA in bfloat16 (the weights' and a reference pool's dtype there) over an fp8 pool, flex
compiled by Triton, the two paths within bfloat16's tolerance of each other (tests/device_tolerances.py)."""
from __future__ import annotations

import pytest
import torch

from models.attention.paged import ItemLayout
from models.attention.backend import AttentionBuilder, choose_backend
from models.kv.paged_cache import PagedKvCache
from models.kv.dtype import FP8, FP8_MAX, Fp8Kv, kv_dtype_name, load_kv, resolve_kv_dtype, store_kv
from models.loader import load_model


def test_resolution():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32) == torch.float32
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
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


def test_store_and_load_convert_to_and_from_the_pool_dtype():
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(1)) * 3
    slots = torch.tensor([0, 3, 17, 30, 31])
    for dtype, rel in ((torch.float32, 0.0), (torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11), (FP8, 2 ** -4)):
        pool = torch.zeros(2, 16, 2, 8, dtype=dtype)
        store_kv(pool, slots, x)
        back = load_kv(pool.view(-1, 2, 8).index_select(0, slots), torch.float32)
        assert back.dtype == torch.float32
        assert float((back - x).abs().max()) <= rel * float(x.abs().max()) + 1e-6, dtype
        assert not pool.view(-1, 2, 8)[1].float().any()  # other slots untouched
    pool = torch.zeros(1, 4, 2, 8, dtype=FP8)
    store_kv(pool, torch.tensor([0]), torch.full((1, 2, 8), -1e6))  # saturated, never NaN
    assert float(load_kv(pool[0, :1], torch.float32).min()) == -FP8_MAX


def test_auto_backend_leaves_flashinfer_out_for_a_converted_pool():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_backend("auto", cpu, kv_converted=True) == "gathered"
    assert choose_backend("auto", cuda, kv_converted=True) == "flex"  # (flashinfer importable or not)
    assert choose_backend("flex", cpu, kv_converted=True) == "flex"


BS, POOL = 16, 24
# logits against a float32 pool's, as a fraction of the largest |logit| (measured on the tiny Llama: bfloat16
# <= 1.1%, fp8_e4m3 <= 17% (3 mantissa bits at scale 1.0); the bounds leave room). Against a bfloat16 pool beside
# bfloat16 weights (CUDA), the activations' own rounding adds up to that dtype's tolerance.
TOLERANCE = {torch.bfloat16: 0.03, torch.float16: 0.01, FP8: 0.3}


def _scenario(model, builders, pools) -> list[torch.Tensor]:
    """test_flex_attention's batches on each (builder, pool) -> per batch, the logits of every pool."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    tables = {"A": [0, 1, 2, 3], "B": [4, 5, 6], "C": [0, 1, 7, 8]}  # C's prompt starts with A's first 32 tokens
    a, b = ids(37), ids(20)
    batches = [[("A", 0, a), ("B", 0, b)], [("A", 37, ids(1)), ("B", 20, ids(15))],
               [("A", 38, ids(4)), ("C", 32, ids(10)), ("B", 35, ids(1))], [("A", 42, ids(1)), ("C", 42, ids(3))]]
    out = []
    with torch.inference_mode():
        for batch in batches:
            items = [ItemLayout(tables[name], past, len(tok)) for name, past, tok in batch]
            input_ids = torch.tensor([t for _, _, tok in batch for t in tok], device=next(model.parameters()).device)
            out.append(torch.stack([model(input_ids, builder(items), kv, None).float().cpu()
                                    for builder, kv in zip(builders, pools)]))
    return out


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bfloat16", "fp8_e4m3"])
def test_gathered_and_flex_over_a_converted_pool(model_dir, kv_dtype, device):
    if kv_dtype == device.dtype:
        pytest.skip(f"{device}'s weights are {kv_dtype} already: nothing is converted")
    model = load_model(model_dir, device.name, device.dtype_name, progress=False)
    cfg = model.config
    where = torch.device(device.name)
    pools = [PagedKvCache(cfg.num_layers, POOL, BS, cfg.num_kv_heads, cfg.head_dim, dtype, where)
             for dtype in (device.dtype, kv_dtype, kv_dtype)]  # the reference: the weights' own dtype (`auto`)
    builders = [AttentionBuilder(name, kv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, where, dtype=device.dtype)
                for name, kv in zip(("gathered", "gathered", "flex"), pools)]
    noise = 1e-4 if device.exact else device.tol.logits  # two paths over the same stored K/V: rounding only
    bound = TOLERANCE[kv_dtype] + (0 if device.exact else device.tol.logits)
    assert pools[1].k.element_size() == (2 if kv_dtype == torch.bfloat16 else 1)  # of float32's 4
    decisive_rows = 0
    for step, (full, gathered, flex) in enumerate(_scenario(model, builders, pools)):
        scale = float(full.abs().max())
        # the same stored K/V through both paths: float32 noise only
        assert torch.allclose(flex, gathered, rtol=1e-4, atol=noise * scale), (step,
                                                                              float((flex - gathered).abs().max()))
        assert float((gathered - full).abs().max()) <= bound * scale, step
        assert float((gathered - full).abs().max()) > 0  # the pool really holds converted values
        # the greedy token agrees in every row whose float32 top two logits are further apart than the row's error
        top2 = full.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * (gathered - full).abs().amax(-1)
        assert torch.equal(gathered.argmax(-1)[decisive], full.argmax(-1)[decisive])
        decisive_rows += int(decisive.sum())
    assert decisive_rows > 0
