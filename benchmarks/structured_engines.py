"""The structured benchmark's grammar engines behind one interface, set up as the scheduler sets up llguidance
(JSON without free whitespace, masks as int32 words filled by the engine's parallel batch call): llguidance and
xgrammar (measured when installed); the model's vocabulary as bytes per id; the cases (structured_cases.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from scheduler.structured.grammar import JSON_OPTIONS


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

    version = staticmethod(lambda: llguidance.__version__)

    def compile(self, kind: str, text: str) -> Any:
        """kind: json_schema or regex (the trajectories' and features' kinds)."""
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS) \
            if kind == "json_schema" else llguidance.LLMatcher.grammar_from_regex(text)
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
        info = xgrammar.TokenizerInfo(list(vocab.tokens), xgrammar.VocabType.RAW, vocab_size=vocab.n_vocab,
                                      stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    version = staticmethod(lambda: __import__("importlib.metadata").metadata.version("xgrammar"))

    def compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(text, any_whitespace=False,
                                                         separators=(JSON_OPTIONS["item_separator"],
                                                                     JSON_OPTIONS["key_separator"]))
            return self.compiler.compile_regex(text)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for unsupported input
            raise EngineError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], masks: np.ndarray) -> None:
        import torch
        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(masks))

    def advance(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def accepts(self, compiled: Any, text: str) -> bool:
        m = self.xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in self.tok.tokenize_bytes(text.encode())) and m.is_completed()


def load(name: str, vocab: Vocabulary) -> Any:
    """The engine, or raises ImportError when it is not installed."""
    return {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](vocab)


CASES = json.loads((Path(__file__).with_name("structured_cases.json")).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Trajectory:
    name: str
    kind: str  # json_schema, regex
    text: str  # the schema (JSON) or the pattern
    output: str  # a valid output the matchers consume


@dataclass(frozen=True)
class Feature:
    name: str
    schema: dict
    valid: str  # an output the schema accepts (written as the scheduler writes JSON)
    invalid: str  # a well-formed JSON output it rejects


TRAJECTORIES = [Trajectory(**t) for t in CASES["trajectories"]]
FEATURES = [Feature(**f) for f in CASES["features"]]
# The overhead runs: JSON objects, one per line, for ever (the grammar is never complete, so every request runs its
# whole length; EOS is held off by min_tokens as in the unconstrained runs).
OVERHEAD_GRAMMAR = 'start: (item "\\n")+\nitem: %json ' + json.dumps({**CASES["overhead_line_schema"],
                                                                     "x-guidance": JSON_OPTIONS})
OVERHEAD_QUESTION = CASES["overhead_question"]
