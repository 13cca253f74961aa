"""The tokenizer and chat template of a GGUF file, as a `tokenizers.Tokenizer` equal to the model's HF
tokenizer.json (same ids), built from the file's `tokenizer.ggml.*` metadata:

- `gpt2` (byte-level BPE: tokens, merges), pre-tokenized as `tokenizer.ggml.pre` names (llama.cpp's names:
  gpt2, smollm/starcoder, llama-bpe/llama3, qwen2, ...), each mapped to the HF pipeline of that family;
- `llama` (SentencePiece BPE: tokens, scores, byte tokens <0xXX>), as transformers' Llama converter builds it
  (merges ranked by the merged token's score, byte fallback, "▁" for spaces).

Control tokens (token type 3) become special added tokens, user-defined ones (4) plain added tokens;
`tokenizer.ggml.add_bos_token` / `add_eos_token` become the post-processor. Anything else is a CheckpointError
naming the field. Torch-free (the header reader imports only numpy).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tandem.errors import CheckpointError
from tandem.gguf_reader import GgufFormatError, GgufHeader

CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # llama.cpp's token types (gguf.TokenType)
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _byte_level() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _split_then_bytes(pattern: str) -> Any:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                             use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer, normalizer or None, BPE ignore_merges), the HF pipeline of the family
# (llama.cpp's llama-vocab.cpp groups the names the same way).
_PRE: dict[str, Any] = {
    "default": lambda: (_byte_level(), None, False),
    "gpt2": lambda: (_byte_level(), None, False),
    # GPT-2's regex after splitting every digit (\p{N}) alone
    "smollm": lambda: (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
                       None, False),
    "starcoder": lambda: _PRE["smollm"](),
    "refact": lambda: _PRE["smollm"](),
    "llama-bpe": lambda: (_split_then_bytes(_LLAMA3_SPLIT), None, True),
    "llama3": lambda: _PRE["llama-bpe"](),
    "llama-v3": lambda: _PRE["llama-bpe"](),
    "qwen2": lambda: (_split_then_bytes(_QWEN2_SPLIT), normalizers.NFC(), False),
    "deepseek-r1-qwen": lambda: _PRE["qwen2"](),
}


class GgufTokenizer:
    """`tokenizer` (tokenizers.Tokenizer) and `config` (what tokenizer_config.json would say: bos/eos/unk/pad
    token texts, chat_template) of the GGUF file at `path` (`meta`: its tokenizer.* keys and values, when the
    caller has read them already: models/gguf/file.py GgufFile.tokenizer_metadata)."""

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._meta = self._read_meta() if meta is None else meta
        kind = self._get("tokenizer.ggml.model", required=True)
        tokens = self._get("tokenizer.ggml.tokens", required=True)
        types = self._get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            tok = self._gpt2(tokens)
        elif kind == "llama":
            tok = self._llama(tokens, types)
        else:
            raise CheckpointError(f"{self.path}: tokenizer.ggml.model={kind!r} is not supported (gpt2 byte-level "
                                  "BPE and llama SentencePiece BPE are)")
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == USER_DEFINED])
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == CONTROL])
        tok.post_processor = self._post_processor(tokens, default_bos=kind == "llama")
        self.tokenizer = tok
        text = lambda key: tokens[self._meta[key]] if isinstance(self._meta.get(key), int) \
            and 0 <= self._meta[key] < len(tokens) else None  # noqa: E731
        self.config: dict[str, Any] = {
            "bos_token": text("tokenizer.ggml.bos_token_id"), "eos_token": text("tokenizer.ggml.eos_token_id"),
            "unk_token": text("tokenizer.ggml.unknown_token_id"), "pad_token": text("tokenizer.ggml.padding_token_id"),
            "chat_template": self._meta.get("tokenizer.chat_template"),
        }

    def _read_meta(self) -> dict[str, Any]:
        try:
            header = GgufHeader(self.path)
        except (OSError, GgufFormatError) as exc:
            raise CheckpointError(f"{self.path}: cannot read it as a GGUF file: {exc}") from exc
        return {k: header.value(k) for k in header.metadata if k.startswith("tokenizer.")}

    def _get(self, key: str, required: bool = False) -> Any:
        value = self._meta.get(key)
        if required and value is None:
            raise CheckpointError(f"{self.path}: no {key} in the metadata: the file carries no tokenizer "
                                  "(pass --tokenizer DIR with the model's tokenizer.json)")
        return value

    # ------------------------------------------------------------------ gpt2: byte-level BPE
    def _gpt2(self, tokens: list[str]) -> Tokenizer:
        pre = self._get("tokenizer.ggml.pre") or "default"
        if pre not in _PRE:
            raise CheckpointError(f"{self.path}: tokenizer.ggml.pre={pre!r} is not supported; Tandem knows "
                                  f"{', '.join(sorted(_PRE))}")
        pre_tokenizer, normalizer, ignore_merges = _PRE[pre]()
        merges = [tuple(m.split(" ", 1)) for m in self._get("tokenizer.ggml.merges", required=True)]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=ignore_merges))
        tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        return tok

    # ------------------------------------------------------------------ llama: SentencePiece BPE
    def _llama(self, tokens: list[str], types: list[int]) -> Tokenizer:
        scores = self._get("tokenizer.ggml.scores", required=True)
        vocab = {t: i for i, t in enumerate(tokens)}
        pieces = [t for i, t in enumerate(tokens) if types[i] not in (CONTROL, BYTE)]
        merges = _merges_by_score(pieces, vocab, {t: s for t, s in zip(tokens, scores)})
        unk_id = self._get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) else None
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        prefix = self._get("tokenizer.ggml.add_space_prefix")
        prefix = prefix is None or bool(prefix)  # a "▁" before the text unless it starts with one
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
        return tok

    # ------------------------------------------------------------------ BOS/EOS
    def _post_processor(self, tokens: list[str], default_bos: bool) -> Any:
        add_bos = self._get("tokenizer.ggml.add_bos_token")
        add_bos = default_bos if add_bos is None else bool(add_bos)
        add_eos = bool(self._get("tokenizer.ggml.add_eos_token"))
        single, special = ["$A"], []
        for add, key, at_end in ((add_bos, "tokenizer.ggml.bos_token_id", False),
                                 (add_eos, "tokenizer.ggml.eos_token_id", True)):
            if add:
                token_id = self._get(key, required=True)
                single.insert(len(single) if at_end else 0, tokens[token_id])
                special.append((tokens[token_id], token_id))
        return processors.TemplateProcessing(single=" ".join(single), special_tokens=special)


def _merges_by_score(pieces: list[str], vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a piece into two vocabulary pieces, ranked by the merged
    piece's score (higher first), ties by the halves' ids (transformers' SentencePieceExtractor)."""
    merges = []
    for piece in pieces:
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((l, r, scores[piece]) for l, r in local)
    merges.sort(key=lambda m: -m[2])  # stable: ties keep the order above
    return [(l, r) for l, r, _ in merges]
