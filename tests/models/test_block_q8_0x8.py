"""Q8_0 rows repacked 8 by 8 (models/native/blocks_q8_0x8.h, kind 208): the layout is the documented one and
keeps the file's bytes; the kernel on int8 activations equals the float64 product of the dequantized weights with
the activations quantized as the kernel quantizes them, and the plain Q8_0 kernel, for 1-5 and 17 activation rows
(passes of 4 and their tails) and row counts with a plain tail; a row's result is the same bits whatever the
other rows of the call; weights at -128 / 127 against activations at +-127 stay exact (the int16 pairs' bound);
dequantized rows and embedding lookups are the plain ones bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.decode.native import load_kernel, machine_refusal
from models.quant.block_formats import FORMATS, dequantize_reference
from tests.models.test_block_kernels import _cpu_has_vnni, q8_activations, random_blocks

pytestmark = pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernels: {machine_refusal()}")

FMT = FORMATS["Q8_0"]
KIND = 208  # Q8_0x8


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernel()


def repack(w: np.ndarray, columns: int) -> torch.Tensor:
    assert torch.ops.tandem.block_repacked_kind(FMT.kind) == KIND and FMT.repacked().kind == KIND
    return torch.ops.tandem.block_repack(torch.from_numpy(w), FMT.kind, columns)


def test_the_layout_is_the_documented_one_and_the_files_bytes():
    """Group-block b of group g (272 bytes = 8 plain blocks of 34): d of row r at 2r, weight 4c + i of row r at
    16 + 32c + 4r + i; the rows past the last group stay as they were."""
    rows, columns = 21, 96
    w = random_blocks(FMT, rows, columns, np.random.default_rng(1))
    packed = repack(w, columns).numpy()
    assert packed.shape == w.shape and packed.nbytes == w.nbytes
    plain = w.reshape(rows, columns // 32, 34)  # [rows, blocks, 34]: d (2 bytes), then 32 int8
    want = np.empty_like(w)
    for g in range(rows // 8):
        for b in range(columns // 32):
            gb = want[8 * g:8 * g + 8].reshape(-1)[272 * b:272 * b + 272]  # (a view: group g's block b)
            for r in range(8):
                gb[2 * r:2 * r + 2] = plain[8 * g + r, b, :2]
                for c in range(8):
                    gb[16 + 32 * c + 4 * r:16 + 32 * c + 4 * r + 4] = plain[8 * g + r, b, 2 + 4 * c:6 + 4 * c]
    want[16:] = w[16:]
    np.testing.assert_array_equal(packed, want)


@pytest.mark.parametrize("rows, blocks_per_row", [(8, 1), (13, 3), (40, 2), (67, 4)])
def test_the_kernel_equals_the_reference_and_the_plain_kernel(rows, blocks_per_row):
    rng = np.random.default_rng(rows)
    columns = 32 * blocks_per_row
    w = random_blocks(FMT, rows, columns, rng)
    packed = repack(w, columns)
    ref = dequantize_reference(w, FMT, columns).astype(np.float64)
    bias = rng.standard_normal(rows).astype(np.float32)
    for m in (1, 2, 3, 4, 5, 17):
        x = rng.standard_normal((m, columns)).astype(np.float32)
        x[0, :32] = 0  # an all-zero activation block (scale 0)
        got = torch.ops.tandem.block_linear(torch.from_numpy(x), packed, KIND, columns, torch.from_numpy(bias)).numpy()
        want = q8_activations(x) @ ref.T + bias
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        plain = torch.ops.tandem.block_linear(torch.from_numpy(x), torch.from_numpy(w), FMT.kind, columns,
                                              torch.from_numpy(bias)).numpy()
        np.testing.assert_allclose(got, plain, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("weight", [-128, 127, "alternating", 0])
def test_the_int16_pairs_bound_stays_exact(weight):
    """|w| = 128 against activations of +-127 (a pair of products 2 * 128 * 127 = 32512, the int16 bound), signs
    mixed within a pair, and zero weights (the sign trick's zero)."""
    rows, columns = 16, 64
    w = random_blocks(FMT, rows, columns, np.random.default_rng(2)).reshape(rows, -1, 34)
    q = w[:, :, 2:].view(np.int8)  # [rows, blocks, 32]
    q[:] = np.tile(np.array([-128, 127], np.int8), 16) if weight == "alternating" else weight
    w = w.reshape(rows, -1)
    packed = repack(w, columns)
    ref = dequantize_reference(w, FMT, columns).astype(np.float64)
    for x in (np.full((3, columns), 1.0, np.float32), np.full((3, columns), -1.0, np.float32),
              np.tile(np.array([1.0, -1.0], np.float32), (3, columns // 2))):
        got = torch.ops.tandem.block_linear(torch.from_numpy(x), packed, KIND, columns).numpy()
        want = q8_activations(x) @ ref.T
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() + 1e-6)


def test_a_row_is_the_same_bits_whatever_the_other_rows():
    rng = np.random.default_rng(3)
    w = random_blocks(FMT, 8 * 5 + 3, 256, rng)
    packed = repack(w, 256)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(3))
    full = torch.ops.tandem.block_linear(x, packed, KIND, 256)
    for m in (1, 2, 3, 4, 5):  # every pass size of 4 rows and its tails, at each position of a pass
        for start in range(0, 17 - m + 1, 3):
            assert torch.equal(torch.ops.tandem.block_linear(x[start:start + m], packed, KIND, 256),
                               full[start:start + m]), (m, start)
    order = torch.randperm(17, generator=torch.Generator().manual_seed(4))
    assert torch.equal(torch.ops.tandem.block_linear(x[order].contiguous(), packed, KIND, 256), full[order])


def test_dequantized_rows_and_lookups_are_the_plain_ones():
    rng = np.random.default_rng(5)
    for rows, blocks_per_row in ((8, 1), (13, 3), (35, 2)):  # whole groups and plain tails
        columns = 32 * blocks_per_row
        w = random_blocks(FMT, rows, columns, rng)
        packed = repack(w, columns)
        plain = torch.ops.tandem.block_dequant(torch.from_numpy(w), FMT.kind, columns)
        assert torch.equal(plain, torch.from_numpy(dequantize_reference(w, FMT, columns)))
        assert torch.equal(torch.ops.tandem.block_dequant(packed, KIND, columns), plain)
        ids = torch.tensor([rows - 1, 0, 7, 3, rows - 1, rows // 2])
        assert torch.equal(torch.ops.tandem.block_rows(packed, KIND, columns, ids), plain[ids])


@pytest.mark.skipif(not _cpu_has_vnni(), reason="this CPU lacks AVX-512 VNNI")
def test_the_vnni_build_gives_the_avx2_bits():
    w = random_blocks(FMT, 8 * 9 + 5, 256, np.random.default_rng(6))
    packed = repack(w, 256)
    x = torch.randn(9, 256)
    try:
        torch.ops.tandem.set_block_isa("avx2")
        want = [torch.ops.tandem.block_linear(x[:m], packed, KIND, 256) for m in (1, 2, 9)]
        torch.ops.tandem.set_block_isa("avx512vnni")
        got = [torch.ops.tandem.block_linear(x[:m], packed, KIND, 256) for m in (1, 2, 9)]
    finally:
        torch.ops.tandem.set_block_isa("avx512vnni")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
