"""CPU weights in transparent huge pages (models/memory/huge_pages.py): the copies hold the same values, 64-byte
aligned in one arena that starts on a 2 MiB boundary, tied weights stay one tensor, small ones stay put;
--huge-pages auto stops copying after its probe where huge pages fault in slowly, on never does, off moves
nothing; an executor's model computes exactly what the loaded model does, its weights' mapping advised."""
from __future__ import annotations

import torch

import pytest

import models.memory.huge_pages as huge_pages
from models.memory.huge_pages import HUGE_PAGE, HugePageArena, copy_to_huge_pages, move_parameters_to_huge_pages
from models.loader import load_model
from tests.executor_driver import make_executor


def test_copies_are_equal_aligned_and_share_one_arena():
    src = [torch.randn(300, 7), torch.arange(10, dtype=torch.int8), torch.randn(5).half()]
    out = copy_to_huge_pages(src)
    for a, b in zip(src, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0 and b.data_ptr() != a.data_ptr()
    assert out[0].data_ptr() % HUGE_PAGE == 0  # the arena starts on a huge page
    assert out[1].data_ptr() - out[0].data_ptr() == 8448  # 300 * 7 * 4 = 8400 bytes, rounded up to 64
    assert copy_to_huge_pages([]) == []


def test_an_arena_refuses_more_than_it_holds():
    arena = HugePageArena(128)
    arena.copy(torch.zeros(16))
    try:
        arena.copy(torch.zeros(32))
    except ValueError as exc:
        assert "64 bytes left" in str(exc)
    else:
        raise AssertionError("an overfull arena must refuse")


def test_moving_a_model_keeps_its_weights_and_ties(model_dir):
    model = load_model(model_dir, "cpu", "float32", progress=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    small = {n: p.data_ptr() for n, p in model.named_parameters() if p.numel() * p.element_size() < 1 << 16}
    moved = move_parameters_to_huge_pages(model, "on")
    assert moved > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        if n in small:
            assert p.data_ptr() == small[n], f"{n} is small: it stays where it was"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_auto_gives_huge_pages_up_where_they_fault_in_slowly(monkeypatch, caplog):
    tensors = [torch.randn(1024) for _ in range(6)]  # 4 KiB each
    monkeypatch.setattr(huge_pages, "PROBE_BYTES", 8192)
    monkeypatch.setattr(huge_pages, "MIN_RATE", 1e30)  # every machine is slow to this probe
    with caplog.at_level("INFO", logger="tandem.models"):
        out = copy_to_huge_pages(tensors, "auto")
    assert [o.data_ptr() != t.data_ptr() for o, t in zip(out, tensors)] == [True, True, False, False, False, False]
    assert all(torch.equal(o, t) for o, t in zip(out, tensors))
    assert "fault in slowly here" in caplog.text and "--huge-pages on" in caplog.text
    assert all(o.data_ptr() != t.data_ptr() for o, t in zip(copy_to_huge_pages(tensors, "on"), tensors))
    monkeypatch.setattr(huge_pages, "MIN_RATE", 0.0)  # and fast to this one
    assert all(o.data_ptr() != t.data_ptr() for o, t in zip(copy_to_huge_pages(tensors, "auto"), tensors))


def test_off_moves_nothing_and_a_wrong_mode_is_refused(model_dir):
    model = load_model(model_dir, "cpu", "float32", progress=False)
    before = [p.data_ptr() for p in model.parameters()]
    assert move_parameters_to_huge_pages(model, "off") == 0
    assert [p.data_ptr() for p in model.parameters()] == before
    with pytest.raises(ValueError, match="unknown --huge-pages 'always'"):
        move_parameters_to_huge_pages(model, "always")


def test_an_executor_on_huge_pages_computes_what_the_loaded_model_does(model_dir):
    ex = make_executor(model_dir, kv_blocks=16, prefix_caching=False, decode_kernel="torch",
                       cpu_packed_weights=False, huge_pages="on")
    ref = load_model(model_dir, "cpu", "float32", progress=False)
    for (n, p), (_, q) in zip(ex.model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    big = max(ex.model.parameters(), key=lambda p: p.numel())
    assert "hg" in vm_flags(big.data_ptr()), "the weights' mapping is not advised MADV_HUGEPAGE"


def vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding address (/proc/self/smaps; "hg" = MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
