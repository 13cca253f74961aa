"""Weights kept in llama.cpp's block formats (models/quant/blocks.py): a BlockWeight multiplies as its
dequantized weight does (the `gguf` package's numpy dequantizer is the oracle), in every format and with parts
of different formats; the embedding dequantizes the rows asked for. Both paths: the numpy fallback (exact up to
float rounding) and, where the native block kernels load, the kernels (8-bit activations: a stated tolerance)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import models.quant.blocks as blocks_module
from models.quant.block_formats import FORMATS, dequantize_reference
from models.quant.blocks import SMALL_ROWS, BlockWeight, QuantEmbedding, block_ops_available
from tests.gguf_files import K_QUANTS, _random_k_blocks

COLUMNS = 512  # whole blocks of 32 and of 256
# The native kernel quantizes activations to 8 bits per block of 32 (llama.cpp's q8_0/q8_K): the product's
# error against float activations, relative to the output's largest value. Measured ~2e-3 at these sizes.
NATIVE_TOLERANCE = 2e-2


def make_blocks(fmt_name: str, rows: int, seed: int) -> np.ndarray:
    """Valid blocks uint8 [rows, row_bytes] of a format (quantized from random weights where gguf can)."""
    rng = np.random.default_rng(seed)
    gtype = GGMLQuantizationType[fmt_name]
    if fmt_name in K_QUANTS:
        return _random_k_blocks((rows, COLUMNS), gtype, rng)
    w = (rng.standard_normal((rows, COLUMNS)) * 0.2).astype(np.float32)
    return np.ascontiguousarray(quants.quantize(w, gtype)).reshape(rows, -1)


@pytest.fixture(params=["numpy", "native"])
def path(request, monkeypatch):
    """Runs a test on the numpy fallback and on the native block kernels (skipped where they do not load)."""
    if request.param == "native" and not block_ops_available():
        pytest.skip("the native block kernels are not in this build of the library")
    monkeypatch.setattr(blocks_module, "_available", request.param == "native")
    return request.param


def check(got: torch.Tensor, want: torch.Tensor, path: str) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err < (1e-5 if path == "numpy" else NATIVE_TOLERANCE), f"{path}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, SMALL_ROWS + 5])  # decode sizes (the kernel) and a prefill chunk
def test_each_format_multiplies_as_its_dequantized_weight(fmt, rows, path):
    data = make_blocks(fmt, 64, seed=1)
    w = torch.from_numpy(dequantize_reference(data, FORMATS[fmt], COLUMNS))  # [64, COLUMNS]
    bias = torch.randn(64)
    weight = BlockWeight([(FORMATS[fmt], torch.from_numpy(data))], COLUMNS, bias)
    assert (weight.out_features, weight.in_features, weight.formats) == (64, COLUMNS, (fmt,))
    assert weight.nbytes == data.nbytes and torch.equal(weight.dequantized(), w)
    x = torch.randn(rows, COLUMNS, generator=torch.Generator().manual_seed(rows))
    check(weight(x), x @ w.T + bias, path)


def test_parts_of_different_formats_are_consecutive_rows(path):
    """A Q4_K_M file's fused q/k/v: Q4_K q and k rows, then Q6_K v rows (and a Q8_0 tail, for a third)."""
    parts = [("Q4_K", 48), ("Q6_K", 16), ("Q8_0", 8)]
    data = [make_blocks(f, r, seed=i) for i, (f, r) in enumerate(parts)]
    weight = BlockWeight([(FORMATS[f], torch.from_numpy(d)) for (f, _), d in zip(parts, data)], COLUMNS, None)
    w = torch.cat([torch.from_numpy(dequantize_reference(d, FORMATS[f], COLUMNS)) for (f, _), d in zip(parts, data)])
    assert weight.out_features == 72 and weight.formats == ("Q4_K", "Q6_K", "Q8_0")
    for rows in (2, 20):
        x = torch.randn(rows, COLUMNS)
        assert weight(x).shape == (rows, 72)
        check(weight(x), x @ w.T, path)
    assert weight(x.bfloat16()).dtype == torch.bfloat16  # computed in float32, returned in the input's dtype


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_row_gets_the_same_numbers_in_a_decode_call_and_in_a_prefill_call(fmt, path):
    """Decode-sized calls run the kernel, larger ones dequantize and multiply in float (with the activations
    rounded to the kernel's 8 bits when it runs): a row's result agrees to float rounding either way, so that a
    recomputed prompt or verified drafts give what decode steps gave."""
    weight = BlockWeight([(FORMATS[fmt], torch.from_numpy(make_blocks(fmt, 64, seed=4)))], COLUMNS, None)
    x = torch.randn(SMALL_ROWS + 5, COLUMNS, generator=torch.Generator().manual_seed(5))
    whole = weight(x)  # [13, 64]: the prefill path
    alone = torch.cat([weight(x[i:i + 1]) for i in range(x.shape[0])])  # the decode path, row by row
    assert float((whole - alone).abs().max() / alone.abs().max()) < 1e-5


def test_the_embedding_dequantizes_the_rows_asked_for(path):
    data = make_blocks("Q8_0", 100, seed=2)
    table = torch.from_numpy(dequantize_reference(data, FORMATS["Q8_0"], COLUMNS))
    emb = QuantEmbedding(BlockWeight([(FORMATS["Q8_0"], torch.from_numpy(data))], COLUMNS, None), torch.float32)
    assert emb.weight.shape == (100, COLUMNS) and emb.weight.dtype == torch.float32 and not emb.weight.requires_grad
    assert emb.weight.untyped_storage().nbytes() == 4  # a stand-in: one element
    ids = torch.tensor([7, 0, 99, 7])
    assert torch.equal(emb(ids), table[ids])


def test_shapes_that_are_not_whole_blocks_are_refused():
    data = torch.from_numpy(make_blocks("Q4_0", 4, seed=3))
    with pytest.raises(ValueError, match="uint8"):
        BlockWeight([(FORMATS["Q4_0"], data[:, :-1])], COLUMNS, None)
    with pytest.raises(ValueError, match="not a multiple"):
        BlockWeight([(FORMATS["Q4_K"], data)], 288, None)


def native_only() -> None:
    if not block_ops_available():
        pytest.skip("the native block kernels are not in this build of the library")


def test_repacking_keeps_one_copy_and_the_products():
    """repack_block_weights rewrites Q4_0 / Q8_0 / Q4_K / Q6_K parts in place (8 rows interleaved), leaves the
    others, and the weight multiplies as before, on the kernel at every size (decode and prefill rows agree)."""
    native_only()
    parts = [("Q4_K", 45), ("Q6_K", 19), ("Q8_0", 11), ("Q4_0", 13), ("Q4_1", 8)]  # tails of the groups of 8
    data = [make_blocks(f, r, seed=10 + i) for i, (f, r) in enumerate(parts)]
    weight = BlockWeight([(FORMATS[f], torch.from_numpy(d.copy())) for (f, _), d in zip(parts, data)], COLUMNS, None)
    holder = torch.nn.Module()
    holder.quant = weight
    w = torch.cat([torch.from_numpy(dequantize_reference(d, FORMATS[f], COLUMNS)) for (f, _), d in zip(parts, data)])
    x = torch.randn(SMALL_ROWS + 5, COLUMNS, generator=torch.Generator().manual_seed(6))
    before = weight(x[:3])
    pointers = [b.data_ptr() for _, b in weight.parts]
    assert blocks_module.repack_block_weights(holder) == sum(d.nbytes for (f, _), d in zip(parts, data) if f != "Q4_1")
    assert [fmt.interleave for fmt, _ in weight.parts] == [8, 8, 8, 8, 1]
    assert weight.formats == ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1")
    assert [b.data_ptr() for _, b in weight.parts] == pointers  # in place: no second copy
    assert not np.array_equal(weight.parts[0][1].numpy(), data[0])
    assert torch.equal(weight.dequantized(), w)
    check(weight(x), x @ w.T, "native")
    assert float((weight(x[:3]) - before).abs().max() / before.abs().max()) < 1e-5
    alone = torch.cat([weight(x[i:i + 1]) for i in range(x.shape[0])])  # a row's numbers whatever the call's rows
    repacked = torch.arange(0, 88)  # (the Q4_1 rows: dequantized at 37 rows)
    assert torch.equal(weight(x)[:, repacked], alone[:, repacked])
    assert blocks_module.repack_block_weights(holder) == 0  # (once)
    with pytest.raises(ValueError, match="repacked 8 by 8"):
        weight.select_columns(0, 256, None)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q6_K"])
def test_a_repacked_embedding_dequantizes_the_rows_asked_for(fmt):
    native_only()
    data = make_blocks(fmt, 21, seed=3)
    table = torch.from_numpy(dequantize_reference(data, FORMATS[fmt], COLUMNS))
    emb = QuantEmbedding(BlockWeight([(FORMATS[fmt], torch.from_numpy(data.copy()))], COLUMNS, None), torch.float32)
    blocks_module.repack_block_weights(emb)
    assert emb.blocks.parts[0][0].interleave == 8
    ids = torch.tensor([7, 0, 20, 16, 7, 15])  # in groups and in the plain tail
    assert torch.equal(emb(ids), table[ids])
    with pytest.raises(IndexError, match="row 21 of 21 rows"):
        emb(torch.tensor([21]))
