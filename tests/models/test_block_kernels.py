"""The native kernels of llama.cpp's block formats (models/native/blocks.h) against the reference: the gguf
package's numpy dequantizer (bit-exact), and for products, float64 products of the dequantized weights with the
activations quantized as the kernel quantizes them (int8 per block of 32, absmax / 127, round half to even).
Random valid blocks of every format, row counts that leave tails of the 4-row tiles, and batch sizes on both
sides of the kernel's 8-row passes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.decode.native import load_kernel, machine_refusal
from models.quant.block_formats import FORMATS, BlockFormat, dequantize_reference

pytestmark = pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernels: {machine_refusal()}")

# (offset, low, high) of each float16 scale in a block: values that give weights of a model's spread
_HALVES = {"Q4_0": [(0, 1e-3, 2e-2)], "Q5_0": [(0, 1e-3, 2e-2)], "Q8_0": [(0, 1e-3, 2e-2)],
           "Q4_1": [(0, 1e-3, 2e-2), (2, -0.1, 0.1)], "Q5_1": [(0, 1e-3, 2e-2), (2, -0.1, 0.1)],
           "Q4_K": [(0, 5e-4, 2e-3), (2, 5e-4, 2e-3)], "Q5_K": [(0, 5e-4, 2e-3), (2, 5e-4, 2e-3)],
           "Q6_K": [(208, 5e-4, 2e-3)]}


def random_blocks(fmt: BlockFormat, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quantized values and scale bytes, float16 scales in a sane range."""
    nb = columns // fmt.block_weights
    raw = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    for offset, low, high in _HALVES[fmt.name]:
        raw[:, :, offset:offset + 2] = rng.uniform(low, high, (rows, nb)).astype(np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


def q8_activations(x: np.ndarray, group: int = 32) -> np.ndarray:
    """x [M, K] as the kernel quantizes it for a format of `group` weights per block (32, or 256: the K-quants'
    activations share one scale per 256 values), back in float64."""
    b = x.reshape(x.shape[0], -1, group)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv).astype(np.float64) * (amax / np.float32(127))).reshape(x.shape)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernel()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequant_is_the_reference_bit_for_bit(name):
    fmt, rng = FORMATS[name], np.random.default_rng(1)
    for rows, blocks_per_row in ((1, 1), (7, 3), (33, 8)):
        columns = blocks_per_row * fmt.block_weights
        w = random_blocks(fmt, rows, columns, rng)
        got = torch.ops.tandem.block_dequant(torch.from_numpy(w), fmt.kind, columns).numpy()
        np.testing.assert_array_equal(got, dequantize_reference(w, fmt, columns))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_linear_equals_the_reference_product(name):
    fmt, rng = FORMATS[name], np.random.default_rng(2)
    for rows, blocks_per_row in ((5, 1), (38, 3), (67, 2)):  # tails of the 4-row tiles
        columns = blocks_per_row * fmt.block_weights
        w = random_blocks(fmt, rows, columns, rng)
        ref = dequantize_reference(w, fmt, columns).astype(np.float64)
        bias = rng.standard_normal(rows).astype(np.float32)
        for m in (1, 3, 8, 11):  # one and two passes of 8 activation rows
            x = rng.standard_normal((m, columns)).astype(np.float32)
            x[0, :fmt.block_weights] = 0  # an all-zero activation block (scale 0)
            got = torch.ops.tandem.block_linear(torch.from_numpy(x), torch.from_numpy(w), fmt.kind, columns,
                                                torch.from_numpy(bias)).numpy()
            want = q8_activations(x, fmt.block_weights) @ ref.T + bias
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
            exact = x.astype(np.float64) @ ref.T + bias  # the activations' rounding: ~1% of the outputs' range
            assert np.abs(got - exact).max() < 0.03 * np.abs(exact).max()


@pytest.mark.parametrize("name, repacked", [("Q4_K", False), ("Q4_0", True), ("Q8_0", True), ("Q4_K", True),
                                            ("Q6_K", True)])
def test_a_row_does_not_depend_on_the_others(name, repacked):
    fmt, rng = FORMATS[name], np.random.default_rng(3)
    w = torch.from_numpy(random_blocks(fmt, 20, 512, rng))
    kind = fmt.kind
    if repacked:  # (4 activation rows at a time there: 9 rows are passes of 4, 4 and 1)
        w, kind = torch.ops.tandem.block_repack(w, fmt.kind, 512), fmt.kind + 100
    x = torch.randn(9, 512)
    alone = torch.cat([torch.ops.tandem.block_linear(x[i:i + 1], w, kind, 512) for i in range(9)])
    assert torch.equal(torch.ops.tandem.block_linear(x, w, kind, 512), alone)


@pytest.mark.parametrize("name, repacked", [("Q8_0", False), ("Q8_0", True), ("Q4_K", True), ("Q6_K", True)])
def test_the_threads_chunks_give_the_same_bits_whatever_the_thread_count(name, repacked):
    """The rows are handed out in chunks from a shared counter (gemm.h's Chunks): which thread takes which
    chunk changes from call to call and with the thread count, the results must not."""
    fmt, rng = FORMATS[name], np.random.default_rng(9)
    w = torch.from_numpy(random_blocks(fmt, 8 * 33 + 5, 256, rng))  # 33 groups of 8 and a plain tail
    kind = fmt.kind
    if repacked:
        w, kind = torch.ops.tandem.block_repack(w, fmt.kind, 256), fmt.kind + 100
    x = torch.randn(3, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.tandem.block_linear(x, w, kind, 256)
        for threads in (2, 3, 5):  # (more threads than cores: chunks taken in any order)
            torch.set_num_threads(threads)
            for _ in range(3):
                assert torch.equal(torch.ops.tandem.block_linear(x, w, kind, 256), one), threads
    finally:
        torch.set_num_threads(before)


def test_bad_inputs_are_refused_naming_them():
    fmt = FORMATS["Q8_0"]
    w = torch.zeros(4, fmt.row_bytes(64), dtype=torch.uint8)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="kind 5 is no block format"):
        torch.ops.tandem.block_linear(x, w, 5, 64)
    with pytest.raises(ValueError, match="columns \\(48\\) must be a positive multiple"):
        torch.ops.tandem.block_dequant(w, fmt.kind, 48)
    with pytest.raises(ValueError, match="blocks must be \\[rows, 68\\] for 64 columns"):
        torch.ops.tandem.block_dequant(w[:, :60].contiguous(), fmt.kind, 64)
    with pytest.raises(TypeError, match="blocks must be uint8"):
        torch.ops.tandem.block_dequant(w.to(torch.int8), fmt.kind, 64)
    with pytest.raises(ValueError, match="x must be a contiguous float32 CPU tensor \\[M, 64\\]"):
        torch.ops.tandem.block_linear(x.double(), w, fmt.kind, 64)
    with pytest.raises(ValueError, match="bias must be a contiguous float32 CPU tensor \\[4\\]"):
        torch.ops.tandem.block_linear(x, w, fmt.kind, 64, torch.zeros(3))


def test_dequant_into_a_callers_buffer():
    fmt, rng = FORMATS["Q6_K"], np.random.default_rng(4)
    w = torch.from_numpy(random_blocks(fmt, 6, 512, rng))
    out = torch.full((6, 512), float("nan"))
    assert torch.ops.tandem.block_dequant(w, fmt.kind, 512, out) is not None
    assert torch.equal(out, torch.ops.tandem.block_dequant(w, fmt.kind, 512))
    with pytest.raises(ValueError, match="out must be a contiguous float32 CPU tensor \\[6, 512\\]"):
        torch.ops.tandem.block_dequant(w, fmt.kind, 512, torch.empty(5, 512))


def _cpu_has_vnni() -> bool:
    flags = open("/proc/cpuinfo").read()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


def test_the_isa_is_chosen_by_the_cpu_and_avx2_can_be_forced():
    assert torch.ops.tandem.block_isa() == ("avx512vnni" if _cpu_has_vnni() else "avx2")
    if not _cpu_has_vnni():
        with pytest.raises(ValueError, match="this CPU lacks AVX-512 VNNI"):
            torch.ops.tandem.set_block_isa("avx512vnni")
    with pytest.raises(ValueError, match="unknown block ISA"):
        torch.ops.tandem.set_block_isa("amx")


@pytest.mark.skipif(not _cpu_has_vnni(), reason="this CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_vnni_build_gives_the_avx2_bits(name):
    fmt, rng = FORMATS[name], np.random.default_rng(5)
    w = torch.from_numpy(random_blocks(fmt, 37, 2 * fmt.block_weights * 4, rng))
    x = torch.randn(9, 2 * fmt.block_weights * 4)
    try:
        torch.ops.tandem.set_block_isa("avx2")
        want = [torch.ops.tandem.block_linear(x[:m], w, fmt.kind, x.shape[1]) for m in (1, 9)]
        torch.ops.tandem.set_block_isa("avx512vnni")
        got = [torch.ops.tandem.block_linear(x[:m], w, fmt.kind, x.shape[1]) for m in (1, 9)]
    finally:
        torch.ops.tandem.set_block_isa("avx512vnni")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


REPACKED = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")  # the formats whose rows are repacked 8 by 8 at load (blocks_x8.h)


def repack(w: np.ndarray, fmt: BlockFormat, columns: int) -> tuple[torch.Tensor, int]:
    kind = torch.ops.tandem.block_repacked_kind(fmt.kind)
    assert kind == fmt.kind + 100
    return torch.ops.tandem.block_repack(torch.from_numpy(w), fmt.kind, columns), kind


@pytest.mark.parametrize("name", REPACKED)
def test_repacked_dequant_is_the_reference_bit_for_bit(name):
    fmt, rng = FORMATS[name], np.random.default_rng(6)
    for rows, blocks_per_row in ((1, 1), (7, 2), (8, 1), (13, 3), (24, 2), (35, 1)):  # groups of 8 and tails
        columns = blocks_per_row * fmt.block_weights
        w = random_blocks(fmt, rows, columns, rng)
        packed, kind = repack(w, fmt, columns)
        assert packed.shape == w.shape and (rows < 8 or not np.array_equal(packed.numpy(), w))
        got = torch.ops.tandem.block_dequant(packed, kind, columns).numpy()
        np.testing.assert_array_equal(got, dequantize_reference(w, fmt, columns))


@pytest.mark.parametrize("name", REPACKED)
def test_repacked_linear_equals_the_reference_product(name):
    fmt, rng = FORMATS[name], np.random.default_rng(7)
    for rows, blocks_per_row in ((5, 1), (8, 2), (19, 3), (40, 1), (67, 2)):  # tails of the groups of 8
        columns = blocks_per_row * fmt.block_weights
        w = random_blocks(fmt, rows, columns, rng)
        packed, kind = repack(w, fmt, columns)
        ref = dequantize_reference(w, fmt, columns).astype(np.float64)
        bias = rng.standard_normal(rows).astype(np.float32)
        for m in (1, 3, 8, 11):
            x = rng.standard_normal((m, columns)).astype(np.float32)
            x[0, :fmt.block_weights] = 0
            x[-1, -16:] *= 50  # a block whose int8 values reach +-127 (the int16 sums' bound)
            got = torch.ops.tandem.block_linear(torch.from_numpy(x), packed, kind, columns,
                                                torch.from_numpy(bias)).numpy()
            want = q8_activations(x, fmt.block_weights) @ ref.T + bias
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
            plain = torch.ops.tandem.block_linear(torch.from_numpy(x), torch.from_numpy(w), fmt.kind, columns,
                                                  torch.from_numpy(bias)).numpy()
            np.testing.assert_allclose(got, plain, rtol=0, atol=2e-6 * np.abs(want).max())


def test_extreme_values_stay_exact_in_the_repacked_kernels():
    """Every weight and activation at the end of its range: the int16 sums of the kernels at their bound."""
    for name in REPACKED:
        fmt = FORMATS[name]
        columns = 2 * fmt.block_weights
        for byte in (0x00, 0xFF):
            w = random_blocks(fmt, 16, columns, np.random.default_rng(8))
            scale_offsets = {o for o, _, _ in _HALVES[name]} | {o + 1 for o, _, _ in _HALVES[name]}
            blk = w.reshape(16, -1, fmt.block_bytes)
            keep = sorted(scale_offsets | (set(range(192, 208)) if name == "Q6_K" else set()) |
                          (set(range(4, 16)) if name == "Q4_K" else set()))
            saved = blk[:, :, keep].copy()
            blk[:, :, :] = byte
            blk[:, :, keep] = saved
            packed, kind = repack(w, fmt, columns)
            ref = dequantize_reference(w, fmt, columns).astype(np.float64)
            for sign in (1.0, -1.0):
                x = np.full((2, columns), sign, dtype=np.float32)
                got = torch.ops.tandem.block_linear(torch.from_numpy(x), packed, kind, columns).numpy()
                want = q8_activations(x, fmt.block_weights) @ ref.T
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() + 1e-6)
