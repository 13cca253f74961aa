"""Grammar constraints compiled for the model's vocabulary with llguidance: a request's constraint (a JSON
schema, any JSON object, a regex, a choice among strings, a Lark or GBNF grammar) becomes a CompiledConstraint
from which every sequence of the request starts its own matcher (scheduler/structured/constraint.py).

Why llguidance (docs/performance.md has the figures, `python -m benchmarks structured` measures them): its
masks for a batch of 32 cost less than xgrammar's on SmolLM2's and Qwen's vocabularies, it covers more of
JSON Schema, and it imports neither torch nor transformers (the scheduler stays torch-free; xgrammar's Python
package imports both).

JSON is generated without free whitespace: items separated by ", ", keys by ": " (as Python's json.dumps
writes it). Unbounded whitespace lets a small model loop on newlines forever; a schema may still ask for it
with llguidance's own keyword, e.g. "x-guidance": {"whitespace_flexible": true}.

Compiling is done in the servicer's worker threads (it may take milliseconds for a large schema); the
tokenizer's llguidance form is built once, on the first constrained request (~0.5 s for SmolLM2), and the
last few compiled constraints are kept, so the same schema sent again costs a dictionary lookup.
"""
from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import llguidance
import numpy as np

from tandem.errors import InvalidRequest
from tandem.token_mask import mask_words

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 4096  # strings of one choice constraint
MAX_ERROR_CHARS = 1000  # of the library's message quoted back to the client
CACHED_CONSTRAINTS = 64  # compiled constraints kept (least recently used goes first)


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the schema (JSON)
    JSON_OBJECT = "json_object"  # any JSON object; text unused
    REGEX = "regex"  # text: the pattern (Rust regex syntax, anchored at both ends)
    CHOICE = "choice"  # choices: the strings, one of which is generated exactly
    GRAMMAR = "grammar"  # text: a Lark grammar (llguidance's dialect) or a GBNF one


@dataclass(frozen=True)
class ConstraintSpec:
    """A request's constraint as the client gave it (domain form of tandem.generate.v1.Constraint)."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A constraint ready for sequences: new_matcher() gives each its own matcher at the grammar's start, and
    initial_mask is the packed mask of the first token (computed once, when compiled)."""

    spec: ConstraintSpec
    initial_mask: bytes
    _template: llguidance.LLMatcher = field(repr=False)

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()  # ~10 us: the grammar and lexer are shared, not rebuilt


class _Tokenizer(Protocol):
    def to_json(self) -> str: ...


class GrammarCompiler:
    def __init__(self, tokenizer: _Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """vocab_size: the model's (the executor's GetInfo), the width of every mask; eos_token_ids: the tokens
        a grammar allows where it may end."""
        self._source = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[ConstraintSpec, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()  # compile() runs in several worker threads

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The constraint ready for sequences; InvalidRequest (with llguidance's message) when it is invalid."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            tokenizer = self._llg_tokenizer()
        grammar = _grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise _invalid(spec.kind, messages[0] if messages else "rejected by llguidance")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _invalid(spec.kind, template.get_error())
        first = template.deep_copy()
        mask = np.zeros(mask_words(self.vocab_size), dtype="<i4")
        first.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        compiled = CompiledConstraint(spec, mask.tobytes(), template)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHED_CONSTRAINTS:
                self._cache.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
        return self._tokenizer


def _grammar(spec: ConstraintSpec) -> str:
    """llguidance's grammar for the spec; InvalidRequest for what is wrong before llguidance sees it."""
    kind = spec.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.text)
        except (ValueError, RecursionError) as exc:  # (llguidance would quote the position in its own wrapper)
            raise InvalidRequest(f"{{field}} is not valid JSON: {exc}", "constraint.json_schema") from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("{field} must be a JSON object (or true / false)", "constraint.json_schema")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, RecursionError) as exc:  # e.g. nested past llguidance's recursion limit
            raise InvalidRequest(f"{{field}} cannot be compiled: {exc}", "constraint.json_schema") from exc
    if kind is ConstraintKind.REGEX:
        if not spec.text:
            raise InvalidRequest("{field} is empty", "constraint.regex")
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if kind is ConstraintKind.CHOICE:
        if not spec.choices or len(spec.choices) > MAX_CHOICES:
            raise InvalidRequest(f"{{field}} needs 1 to {MAX_CHOICES} strings, got {len(spec.choices)}",
                                 "constraint.choice")
        if any(not c for c in spec.choices):
            raise InvalidRequest("{field} strings must not be empty", "constraint.choice")
        return llguidance.grammar_from("choice", list(spec.choices))
    if not spec.text:
        raise InvalidRequest("{field} is empty", "constraint.grammar")
    try:
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise _invalid(kind, str(exc)) from exc


def _invalid(kind: ConstraintKind, message: str) -> InvalidRequest:
    text = message.strip()
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return InvalidRequest(f"{{field}} is invalid: {text}", f"constraint.{kind.value}")
