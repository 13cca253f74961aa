"""The scheduler's flags for embeddings and scoring (--max-embedding-inputs, --rerank-*): how many inputs one
request may carry, and how /v1/score, /v1/rerank score a (query, document) pair (scheduler/pooling/scoring.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

RERANK_MODES = ("auto", "classifier", "yes-no", "off")
# Qwen3-Reranker's default instruction (its model card's format_instruction)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class PoolingConfig:
    max_inputs: int = 2048  # inputs of one /v1/embeddings request (OpenAI's limit), documents of one rerank
    # auto: the model's classification head if it has one, else yes-no when its name says "reranker", else off
    rerank_mode: str = "auto"
    rerank_tokens: tuple[str, str] = ("yes", "no")  # yes-no: the tokens whose logits decide (relevant, not)
    rerank_instruction: str = DEFAULT_INSTRUCTION  # yes-no: the <Instruct> of the prompt

    def validate(self) -> None:
        if self.max_inputs < 1:
            raise ValueError(f"--max-embedding-inputs must be >= 1, got {self.max_inputs}")
        if self.rerank_mode not in RERANK_MODES:
            raise ValueError(f"--rerank-mode must be one of {', '.join(RERANK_MODES)}, got {self.rerank_mode!r}")
        if len(self.rerank_tokens) != 2 or not all(self.rerank_tokens) or len(set(self.rerank_tokens)) != 2:
            raise ValueError(f"--rerank-tokens takes two different tokens YES,NO, got {','.join(self.rerank_tokens)!r}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = PoolingConfig()
    g = ap.add_argument_group("embeddings and scoring (with --http-port: /v1/embeddings, /v1/score, /v1/rerank; gRPC "
                              "Embed; docs/agents.md#embeddings-and-rerank)")
    g.add_argument("--max-embedding-inputs", type=int, default=d.max_inputs, metavar="N",
                   help="inputs one /v1/embeddings (or gRPC Embed) request may carry, and documents one /v1/rerank "
                        "or /v1/score request may score; more is 400. They run --max-running at a time "
                        f"(default {d.max_inputs})")
    g.add_argument("--rerank-mode", choices=RERANK_MODES, default=d.rerank_mode,
                   help="how /v1/score and /v1/rerank score a (query, document) pair: 'classifier' = the model's "
                        "sequence-classification head on the pair (a *ForSequenceClassification checkpoint; sigmoid "
                        "of one label, else the probability of label 1); 'yes-no' = a decoder LM asked whether the "
                        "document meets the query in Qwen3-Reranker's prompt format, scored softmax(yes, no)[yes] "
                        "at the last position; 'auto' (default) = classifier when the model has a head, yes-no when "
                        "its name contains 'reranker', else the routes answer 400; 'off' = never")
    g.add_argument("--rerank-tokens", default=",".join(d.rerank_tokens), metavar="YES,NO",
                   help="yes-no mode: the vocabulary tokens meaning relevant and not relevant "
                        f"(default {','.join(d.rerank_tokens)}, as Qwen3-Reranker)")
    g.add_argument("--rerank-instruction", default=d.rerank_instruction, metavar="TEXT",
                   help="yes-no mode: the <Instruct> line of the prompt (default Qwen3-Reranker's: "
                        f"{d.rerank_instruction!r})")


def from_args(args: argparse.Namespace) -> PoolingConfig:
    return PoolingConfig(args.max_embedding_inputs, args.rerank_mode, tuple(args.rerank_tokens.split(",")),
                         args.rerank_instruction)
