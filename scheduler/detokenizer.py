"""Incremental detokenization that never emits a broken character.

Decoding token by token is wrong twice over: byte-level BPE splits multi-byte UTF-8 characters across
tokens (a lone piece decodes to U+FFFD), and SentencePiece-style decoders drop or add a leading space
depending on what precedes a token. So, as TGI and vLLM do, we decode a short window of ids twice —
[prefix, read) and [prefix, end) — and emit the difference once it no longer ends in U+FFFD. The window
starts on the last few prompt tokens, which give the first output token its context.
"""
from __future__ import annotations

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens (vLLM uses 5 too)


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # ids before this are already emitted
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (maybe "", e.g. half of a multi-byte character)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete: wait for the next token
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever is still pending, even if it is an incomplete character."""
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        delta = after[len(before):] if len(after) > len(before) else ""
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
