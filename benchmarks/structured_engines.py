"""The two grammar engines the structured-output comparison measures, behind one small interface: llguidance
(what the scheduler uses, scheduler/grammar.py) and xgrammar (optional: measured when it is installed).

Both are set up as the scheduler sets up llguidance: JSON without free whitespace, separators ", " and ": "
(scheduler/grammar.py JSON_OPTIONS), masks as int32 words [batch, ceil(vocab / 32)], filled for the whole batch
at once by the engine's own parallel batch call (llguidance's LLExecutor, xgrammar's BatchGrammarMatcher).
"""
from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from benchmarks.structured_vocab import Vocabulary
from scheduler.grammar import JSON_OPTIONS


class EngineError(Exception):
    """The engine refused a grammar (its message)."""


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: Vocabulary, tokenizer: llguidance.LLTokenizer) -> None:
        self.tok = tokenizer
        self.vocab = vocab
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

    def __init__(self, vocab: Vocabulary, tokenizer: llguidance.LLTokenizer) -> None:
        import xgrammar  # optional (it imports torch and transformers): measured only when installed
        self.xgr = xgrammar
        self.tok = tokenizer  # only to tokenize the coverage texts the same way for both engines
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


def load(name: str, vocab: Vocabulary, tokenizer: llguidance.LLTokenizer):
    """The engine, or raises ImportError when it is not installed."""
    return {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](vocab, tokenizer)


def schema(text: dict) -> str:
    return json.dumps(text)
