"""tandem/gguf_reader.py reads what the `gguf` package's GGUFReader reads (every metadata value, every tensor's
bytes), without decoding the tokenizer's arrays until asked: the executor's open (models/gguf/loader.py
read_gguf_config) decodes none of them."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from models.gguf.file import GgufFile
from models.gguf.loader import read_gguf_config
from tandem.gguf_reader import LazyArray
from tandem.errors import CheckpointError
from tests.gguf_files import write_gguf

TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


@pytest.fixture(scope="module")
def gguf_path(model_dir, tmp_path_factory):
    path, _ = write_gguf(model_dir, tmp_path_factory.mktemp("gguf") / "tiny-Q4_0.gguf", "Q4_0")
    return path


def test_the_executors_open_decodes_no_tokenizer_array(gguf_path):
    gguf, raw, cfg = read_gguf_config(gguf_path)
    assert gguf.header.decoded_arrays == 0
    assert all(isinstance(gguf.header.metadata[k], LazyArray) for k in TOKENIZER_ARRAYS)
    assert cfg.vocab_size == raw["vocab_size"] and not any(k in gguf.metadata for k in TOKENIZER_ARRAYS)
    tokens = gguf.tokenizer_field("tokenizer.ggml.tokens")
    assert gguf.header.decoded_arrays == 1 and len(tokens) == cfg.vocab_size


def test_values_and_tensor_bytes_equal_ggufreaders(gguf_path):
    ours, theirs = GgufFile(gguf_path), GGUFReader(gguf_path)
    values = {**ours.metadata, **ours.tokenizer_metadata()}
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert values.keys() == want.keys()
    for key, value in want.items():
        assert values[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    for t in theirs.tensors:
        got = ours.raw(t.name)
        assert got.shape == t.data.shape and np.array_equal(got.view(np.uint8), t.data.view(np.uint8)), t.name
        assert ours.tensor_types[t.name] == t.tensor_type.name


def test_a_truncated_file_is_a_checkpoint_error(gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:5000])  # inside the tokenizer's arrays
    with pytest.raises(CheckpointError, match="cannot read it as a GGUF file"):
        GgufFile(cut)
