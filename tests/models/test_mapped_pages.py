"""models/memory/mapped_pages.py: a weight's pages in a mapped safetensors file are released (and read back from
the file, unchanged), an anonymous tensor's never; mappings_as_of_now() and passed spans release exactly what a
fresh read of /proc/self/maps does."""
from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.memory.mapped_pages import file_mappings, in_mappings, mappings_as_of_now, release_file_pages

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists() or not hasattr(mmap, "MADV_DONTNEED"),
                                reason="needs Linux /proc and madvise")


def mapped_weight(tmp_path: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [256, 1024] float32 weight as the loader reads it: a view of the file's mapping, the same values in
    anonymous memory)."""
    values = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))  # 1 MiB: many whole pages
    save_file({"w": values}, str(tmp_path / f"{name}.safetensors"))
    handle = safe_open(str(tmp_path / f"{name}.safetensors"), framework="pt")
    weight = handle.get_tensor("w")
    assert in_mappings(weight, file_mappings()), "safetensors no longer maps the file: these tests test nothing"
    return weight, values


def test_a_mapped_weights_pages_are_released_and_read_back_unchanged(tmp_path):
    weight, values = mapped_weight(tmp_path, "a")
    assert torch.equal(weight, values)  # (its pages read in)
    released = release_file_pages([weight])
    assert released >= 1_000_000 - 2 * mmap.PAGESIZE and released % mmap.PAGESIZE == 0
    assert torch.equal(weight, values)  # faulted in again from the file
    anonymous = values.clone()
    assert release_file_pages([anonymous]) == 0 and torch.equal(anonymous, values)


def test_one_read_of_the_mappings_releases_what_a_read_per_call_does(tmp_path):
    a, a_values = mapped_weight(tmp_path, "a")
    b, b_values = mapped_weight(tmp_path, "b")
    anonymous = a_values.clone()
    expected = [release_file_pages([t]) for t in (a, b, anonymous)]  # a fresh read of /proc/self/maps each
    assert expected[0] > 0 and expected[1] > 0 and expected[2] == 0
    with mappings_as_of_now():
        assert [release_file_pages([t]) for t in (a, b, anonymous)] == expected
    spans = file_mappings()
    assert [release_file_pages([t], spans) for t in (a, b, anonymous)] == expected
    assert release_file_pages([a], []) == 0  # (spans that hold no file mapping: nothing is released)
    assert torch.equal(a, a_values) and torch.equal(b, b_values) and torch.equal(anonymous, a_values)
