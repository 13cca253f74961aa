"""The structured-output benchmark's grammar engines behind one small interface, set up as the scheduler sets up
llguidance (JSON without free whitespace, separators ", " and ": ", masks as int32 words [batch, ceil(vocab / 32)]
filled for the whole batch by the engine's parallel batch call): llguidance (scheduler/grammar.py) and xgrammar
(optional: measured when installed); the model's vocabulary as bytes per token id, so both see the same tokens;
and what the benchmark runs: grammars with a valid output each, the JSON Schema features whose support it checks,
and the never-ending JSON-lines grammar of the overhead runs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from scheduler.grammar import JSON_OPTIONS


@dataclass
class Vocabulary:
    name: str
    tokens: list[bytes]  # by token id; b"" for special tokens and padding
    n_vocab: int  # the model's vocabulary (mask width)
    eos: int
    tokenizer: llguidance.LLTokenizer


def model_vocabulary(model_dir: Path, n_vocab: int, eos: int) -> Vocabulary:
    """The model's own vocabulary (tokenizer.json, as the scheduler loads it), each id decoded to its bytes."""
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=n_vocab, eos_token=eos)
    tokens = [b"" if tok.is_special_token(i) else tok.decode_bytes([i]) for i in range(n_vocab)]
    return Vocabulary(f"{model_dir.name} ({n_vocab})", tokens, n_vocab, eos, tok)


class EngineError(Exception):
    """The engine refused a grammar (its message)."""


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: Vocabulary) -> None:
        self.tok = vocab.tokenizer
        self.executor = llguidance.LLExecutor()

    @staticmethod
    def version() -> str:
        return llguidance.__version__

    def compile(self, kind: str, text: str) -> Any:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.grammar_from("grammar", text)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tok)
        if error and not error.startswith("WARNING"):
            raise EngineError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = llguidance.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise EngineError(m.get_error())
        return m

    def fill(self, matchers: list[Any], masks: np.ndarray) -> None:
        llnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], masks)

    def advance(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def reset(self, m: Any) -> None:
        m.reset()

    def accepts(self, compiled: Any, text: str) -> bool:
        m = llguidance.LLMatcher(self.tok, compiled, log_level=0)
        ids = self.tok.tokenize_bytes(text.encode())
        return m.consume_tokens(ids) and m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocabulary) -> None:
        import xgrammar  # optional (it imports torch and transformers): measured only when installed
        self.xgr = xgrammar
        self.tok = vocab.tokenizer  # only to tokenize the coverage texts the same way for both engines
        info = xgrammar.TokenizerInfo(list(vocab.tokens),
                                      xgrammar.VocabType.RAW, vocab_size=vocab.n_vocab, stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    @staticmethod
    def version() -> str:
        from importlib.metadata import version
        return version("xgrammar")

    def compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(text, any_whitespace=False,
                                                         separators=(JSON_OPTIONS["item_separator"],
                                                                     JSON_OPTIONS["key_separator"]))
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(_lark_to_ebnf(text))
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for unsupported input
            raise EngineError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], masks: np.ndarray) -> None:
        import torch
        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(masks))

    def advance(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def reset(self, m: Any) -> None:
        m.reset()

    def accepts(self, compiled: Any, text: str) -> bool:
        m = self.xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in self.tok.tokenize_bytes(text.encode())) and m.is_completed()


def _lark_to_ebnf(text: str) -> str:
    """The workloads' grammars are written in the Lark subset both engines read once `start` is `root` and
    `:` is `::=` (xgrammar takes GBNF)."""
    return "\n".join(line.replace("start:", "root ::=", 1) if line.startswith("start:") else
                     line.replace(":", " ::=", 1) for line in text.strip().splitlines())

def load(name: str, vocab: Vocabulary) -> Any:
    """The engine, or raises ImportError when it is not installed."""
    return {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](vocab)


@dataclass(frozen=True)
class Trajectory:
    name: str
    kind: str  # json_schema, regex
    text: str  # the schema (JSON) or the pattern
    output: str  # a valid output the matchers consume


_ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
         "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                        "price": {"type": "number", "minimum": 0}}}
TRAJECTORIES = [
    Trajectory("person", "json_schema", json.dumps({
        "type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags", "address"],
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 150},
                       "email": {"type": "string", "format": "email"},
                       "tags": {"type": "array", "items": {"enum": ["admin", "staff", "guest"]}, "maxItems": 3},
                       "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                   "properties": {"city": {"type": "string"},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
               '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["admin", "staff"], '
               '"address": {"city": "London", "zip": "12345"}}'),
    Trajectory("order_ref", "json_schema", json.dumps({
        "$defs": {"item": _ITEM}, "type": "object", "additionalProperties": False, "required": ["id", "items"],
        "properties": {"id": {"type": "integer"}, "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                            "minItems": 1},
                       "note": {"type": ["string", "null"]}}}),
               '{"id": 9001, "items": [{"sku": "ABC-1234", "qty": 2, "price": 9.99}, '
               '{"sku": "XYZ-0001", "qty": 10, "price": 0.5}], "note": null}'),
    Trajectory("any_of", "json_schema", json.dumps({
        "type": "array", "maxItems": 8, "items": {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["kind", "radius"],
             "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0}}},
            {"type": "object", "additionalProperties": False, "required": ["kind", "w", "h"],
             "properties": {"kind": {"const": "rect"}, "w": {"type": "integer"}, "h": {"type": "integer"}}}]}}),
               '[{"kind": "circle", "radius": 2.5}, {"kind": "rect", "w": 3, "h": 4}, '
               '{"kind": "circle", "radius": 1}]'),
    Trajectory("phone_regex", "regex", r"\+[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?",
               "+44 (207) 946-0958 ext. 123"),
]


@dataclass(frozen=True)
class Feature:
    name: str
    schema: dict
    valid: str  # an output the schema accepts (written as the scheduler writes JSON)
    invalid: str  # a well-formed JSON output it rejects


_OBJ = {"type": "object", "additionalProperties": False}
FEATURES = [
    Feature("nested objects", {**_OBJ, "required": ["a"], "properties": {"a": {**_OBJ, "required": ["b"],
                                                                                "properties": {"b": {"type": "integer"}}}}},
            '{"a": {"b": 1}}', '{"a": {"c": 1}}'),
    Feature("required / optional", {**_OBJ, "required": ["a"], "properties": {"a": {"type": "integer"},
                                                                             "b": {"type": "integer"}}},
            '{"a": 1}', '{"b": 1}'),
    Feature("enum", {"enum": ["red", "green", 3]}, '"green"', '"blue"'),
    Feature("const", {"const": "fixed"}, '"fixed"', '"other"'),
    Feature("integer bounds", {"type": "integer", "minimum": 10, "maximum": 20}, "15", "25"),
    Feature("exclusive bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "0.5", "1"),
    Feature("multipleOf", {"type": "integer", "multipleOf": 5}, "15", "12"),
    Feature("string length", {"type": "string", "minLength": 2, "maxLength": 3}, '"abc"', '"abcd"'),
    Feature("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]+$"}, '"ab-12"', '"ab12"'),
    Feature("format: date-time", {"type": "string", "format": "date-time"}, '"2024-01-02T03:04:05Z"', '"yesterday"'),
    Feature("format: email", {"type": "string", "format": "email"}, '"a@b.org"', '"not an email"'),
    Feature("format: uuid", {"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"',
            '"123"'),
    Feature("array min/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
            "[1, 2]", "[1, 2, 3]"),
    Feature("prefixItems (tuples)", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                     "items": False}, '[1, "a"]', '["a", 1]'),
    Feature("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    Feature("$ref / $defs", {"$defs": {"p": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/p"}},
            "[1, 2]", '["x"]'),
    Feature("recursive $ref", {"$defs": {"node": {**_OBJ, "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"},
            '{"v": 1, "next": {"v": 2}}', '{"v": 1, "next": {"w": 2}}'),
    Feature("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, '"ab"', '"abc"'),
    Feature("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    Feature("allOf", {"allOf": [{**_OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                {"type": "object", "required": ["a"]}]}, '{"a": 1}', '{"b": 1}'),
    Feature("type lists / null", {"type": ["integer", "null"]}, "null", '"x"'),
    Feature("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
            '{"k": 1}', '{"k": "v"}'),
    Feature("patternProperties", {"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
                                  "additionalProperties": False}, '{"x-a": 1}', '{"y": 1}'),
    Feature("minProperties / maxProperties", {"type": "object", "minProperties": 1, "maxProperties": 1,
                                              "additionalProperties": {"type": "integer"}}, '{"a": 1}', "{}"),
    Feature("if / then / else", {"if": {"type": "integer"}, "then": {"minimum": 5}, "else": {"type": "string"}},
            "7", "3"),
    Feature("not", {"not": {"type": "string"}}, "1", '"x"'),
    Feature("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]},
                                  "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
            '{"a": 1, "b": 2}', '{"a": 1}'),
]

# The step-overhead runs: JSON objects, one per line, for ever (the grammar is never complete, so every
# request runs its whole --output-len; EOS is held off by min_new_tokens as in the unconstrained runs).
LINE_SCHEMA = {**_ITEM, "properties": {**_ITEM["properties"], "name": {"type": "string", "maxLength": 24}},
               "required": ["sku", "name", "qty", "price"], "x-guidance": JSON_OPTIONS}
OVERHEAD_GRAMMAR = 'start: (item "\\n")+\nitem: %json ' + json.dumps(LINE_SCHEMA)
OVERHEAD_QUESTION = ("List products of a hardware store, one JSON object per line with sku, name, qty and "
                     "price.")
