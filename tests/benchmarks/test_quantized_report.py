"""The quantized benchmark's pure parts: a random shape written as a GGUF file the way llama.cpp's converter
writes it (read back by Tandem's own GGUF reader: names, shapes, config, q/k permutation, padded tokenizer), and
the table rows, ratios and targets made from results."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import gguf_shapes
from benchmarks.quantized_report import GIB, memory_check, serving_rows, side_text, speed_rows, verdict
from benchmarks.shapes import SHAPES

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def tokenizer_source(tmp_path_factory):
    """A GGUF file holding only a 16-token byte-level BPE tokenizer (the shipped SmolLM2 one takes seconds to
    parse)."""
    from gguf import GGUFWriter
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list("abcdefghijklm"))
    w.add_token_types([3, 3, 3] + [1] * 13)
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("shape", ["smollm2-1.7b", "qwen3-1.7b"])
def test_shape_file_reads_back_as_the_shape(tmp_path, tokenizer_source, shape):
    from models.gguf.config import hf_config
    from models.gguf.file import GgufFile
    from models.gguf.tensors import HfTensors, unpermute_rope_rows

    config = dict(SHAPES[shape][1], **TINY, num_key_value_heads=2, vocab_size=16 if shape == "smollm2-1.7b" else 40)
    if shape == "qwen3-1.7b":
        config["head_dim"] = 32
    out = gguf_shapes.write_shape_gguf(tmp_path / "m.gguf", shape, 7, tokenizer_source, config=config)
    f = GgufFile(out)
    hf = hf_config(f.metadata, f.tensor_shapes, f.tensor_types, str(out))
    assert (hf["model_type"], hf["vocab_size"], hf["num_hidden_layers"], hf["num_key_value_heads"]) == \
        ("llama" if shape == "smollm2-1.7b" else "qwen3", config["vocab_size"], 2, 2)
    assert hf["tie_word_embeddings"] and "output.weight" not in f.tensor_shapes
    assert set(f.tensor_types.values()) == {"F32"}
    assert dict(gguf_shapes.tensor_shapes(gguf_shapes.shape_config(shape)[0], config)) == f.tensor_shapes
    tensors = HfTensors(f, hf)
    names = list(f.tensor_shapes)
    i = names.index("blk.1.attn_k.weight")
    stored = gguf_shapes.random_tensor("blk.1.attn_k.weight", f.tensor_shapes[names[i]], i, 7,
                                       gguf_shapes.shape_config(shape)[0], config)
    assert np.array_equal(f.tensor("blk.1.attn_k.weight"), stored)
    k = tensors.read("model.layers.1.self_attn.k_proj.weight")  # HF order: un-permuted for llama only
    assert np.array_equal(k, unpermute_rope_rows(stored, 2) if shape == "smollm2-1.7b" else stored)
    assert abs(float(k.std()) - gguf_shapes.WEIGHT_STD) < 0.002
    tokens, types = f.tokenizer_field("tokenizer.ggml.tokens"), f.tokenizer_field("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == config["vocab_size"]
    if config["vocab_size"] > 16:  # the source's vocabulary padded as convert_hf_to_gguf pads
        assert tokens[16:] == [f"[PAD{i}]" for i in range(16, 40)] and set(types[16:]) == {5}
    assert tokens[:16] == source_tokens(tokenizer_source)


def source_tokens(path):
    from models.gguf.file import GgufFile
    return GgufFile(path).tokenizer_field("tokenizer.ggml.tokens")


def test_rows_ratios_and_targets():
    file_bytes = int(GIB)
    files = [{"shape": "s", "type": "Q4_0", "file_bytes": file_bytes, "bytes_per_token": file_bytes,
              "tandem": {"decode_tok_s": 12.0, "prefill_tok_s": 50.0, "memory": {"rss": int(1.5 * GIB)}},
              "llama": {"decode_tok_s": 10.0, "prefill_tok_s": 100.0},
              "serving": {"tandem": {"output_tok_s": 26.0, "ttft_p50_ms": 900.0, "failed": 0, "exact": 4},
                          "llama": {"output_tok_s": 20.0, "ttft_p50_ms": 1000.0, "failed": 1, "exact": 3},
                          "agreement": {"compared": 3, "identical": 2, "mean_common_prefix": 5.0}}},
             {"shape": "s", "type": "Q8_0", "file_bytes": file_bytes, "bytes_per_token": file_bytes}]
    rows = speed_rows(files, bandwidth=10 * GIB)
    assert rows[0]["decode T/L"] == pytest.approx(1.2) and rows[0]["decode ok"] == "ok"
    assert rows[0]["pp T/L"] == pytest.approx(0.5) and rows[0]["pp ok"] == "below"
    assert rows[0]["BW bound"] == pytest.approx(10.0) and rows[0]["T/bound"] == pytest.approx(1.2)
    assert rows[0]["L/bound"] == pytest.approx(1.0) and rows[0]["RSS/file"] == pytest.approx(1.5)
    assert rows[0]["mem ok"] == "ok"  # 1.5 GiB within 1.15 x 1 GiB + 0.5 GiB
    assert rows[1]["decode T/L"] is None and rows[1]["decode ok"] == "-" and rows[1]["mem ok"] == "-"
    (srow,) = serving_rows(files)
    assert srow["tok/s T/L"] == pytest.approx(1.3) and srow["tok/s ok"] == "ok"
    assert srow["TTFT T/L"] == pytest.approx(0.9) and srow["TTFT ok"] == "ok" and srow["failed T/L"] == "0/1"
    assert srow["exact T/L"] == "4/3" and srow["same tokens"] == "2/3"
    assert side_text(files[0]["serving"]["llama"]) == "20.0 out tok/s, TTFT p50 1000 ms, 1 failed"
    assert side_text({"output_tok_s": None, "ttft_p50_ms": None, "failed": 4}) == "- out tok/s, TTFT p50 - ms, 4 failed"
    assert verdict(1.1, (1.0, "lower")) == "above" and verdict(None, (1.0, "higher")) == "-"
    assert memory_check(int(1.7 * GIB), file_bytes)["memory_ok"] is False
