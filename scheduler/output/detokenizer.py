"""Incremental detokenization that never emits a broken character.

Decoding token by token is wrong twice over: byte-level BPE splits multi-byte UTF-8 characters across
tokens (a lone piece decodes to U+FFFD), and SentencePiece-style decoders drop or add a leading space
depending on what precedes a token. So, as TGI and vLLM do, we decode a short window of ids twice —
[prefix, read) and [prefix, end) — and emit the difference once it no longer ends in U+FFFD. The window
starts on the last few prompt tokens, which give the first output token its context.

The window is bounded: tokens that decode to nothing (skipped special tokens) or a run that never completes
a character would otherwise grow it forever, and every token would decode all of it again. After
_MAX_PENDING such tokens the window moves on, emitting what they decode to (U+FFFD included).
"""
from __future__ import annotations

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens (vLLM uses 5 too)
_MAX_PENDING = 16  # tokens held back without emitting text; a UTF-8 character spans at most 4 byte tokens


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
            if len(self._ids) - self._read < _MAX_PENDING:
                return ""  # nothing new yet, or a character still incomplete: wait for the next token
        delta = after[len(before):] if len(after) > len(before) else ""
        self._advance()
        self.text += delta
        return delta

    def _advance(self) -> None:
        """Everything decoded is emitted: the next window starts at the last emitted tokens (their context)."""
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[:self._prefix]  # ids before the window are never decoded again
        self._read -= self._prefix
        self._prefix = 0

    def flush(self) -> str:
        """At the end of a sequence: whatever is still pending, even if it is an incomplete character."""
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        delta = after[len(before):] if len(after) > len(before) else ""
        self._advance()
        self.text += delta
        return delta
