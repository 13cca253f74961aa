"""How /v1/score and /v1/rerank score a (query, document) pair, decided once per request from the model and
--rerank-mode (scheduler/pooling/config.py):

- classifier: a *ForSequenceClassification checkpoint's head on the pair as the tokenizer joins pairs (as
  transformers' `tokenizer(query, document)`); one label: sigmoid of its output (sentence-transformers'
  CrossEncoder default), several: softmax over them, the probability of label 1;
- yes-no: a decoder LM asked in Qwen3-Reranker's prompt format (its model card) whether the document meets the
  query; the score is softmax over the logits of the "yes" and "no" tokens at the last position, P(yes).
The query's prompt prefix is the same for every document, so its full KV blocks come from the prefix cache after
the first document."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scheduler.executor.info import ExecutorInfo
from scheduler.pooling.config import PoolingConfig
from scheduler.pooling.inputs import FieldError, check_prompt, pooling_facts
from scheduler.request import PoolingSpec
from tandem.errors import Unsupported

# Qwen3-Reranker's prompt (its model card): system + user turn, then an empty thinking block before the answer.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


@dataclass(frozen=True)
class Scorer:
    mode: str  # classifier | yes-no
    spec: PoolingSpec
    instruction: str = ""

    def prompt(self, tokenizer, query: str, document: str) -> list[int]:
        if self.mode == "classifier":
            return tokenizer.encode_pair(query, document)
        body = BODY.format(instruction=self.instruction, query=query, document=document)
        return [*tokenizer.encode(PREFIX, False), *tokenizer.encode(body, False), *tokenizer.encode(SUFFIX, False)]

    def score(self, values: Sequence[float]) -> float:
        if self.mode == "yes-no":  # values: (no, yes) logits
            return 1.0 / (1.0 + math.exp(values[0] - values[1]))
        if len(values) == 1:
            return 1.0 / (1.0 + math.exp(-values[0]))
        top = max(values)
        exps = [math.exp(v - top) for v in values]
        return exps[1] / sum(exps)


def scorer(info: ExecutorInfo, tokenizer, cfg: PoolingConfig) -> Scorer:
    """The scorer of this model, or Unsupported saying why it scores nothing."""
    facts = pooling_facts(info)
    mode = cfg.rerank_mode
    if mode == "auto":
        mode = ("classifier" if facts.num_labels else
                "yes-no" if facts.lm_head and "reranker" in info.model_id.lower() else "off")
    if mode == "off":
        raise Unsupported(f"model {info.model_id!r} scores no pairs here: /v1/score and /v1/rerank need a "
                          "sequence-classification checkpoint (*ForSequenceClassification) or a yes/no reranker "
                          "(Qwen3-Reranker style: start the scheduler with --rerank-mode yes-no)"
                          + (" (--rerank-mode off)" if cfg.rerank_mode == "off" else ""))
    if mode == "classifier":
        if not facts.num_labels:
            raise Unsupported(f"--rerank-mode classifier: model {info.model_id!r} has no sequence-classification head")
        return Scorer(mode, PoolingSpec("classify"))
    if not facts.lm_head:
        raise Unsupported(f"--rerank-mode yes-no: model {info.model_id!r} has no LM head (a classifier: use "
                          "--rerank-mode classifier)")
    ids = [tokenizer.token_id(t) for t in cfg.rerank_tokens]
    missing = [t for t, i in zip(cfg.rerank_tokens, ids) if i is None or i >= info.vocab_size]
    if missing:
        raise Unsupported(f"model {info.model_id!r}'s vocabulary has no token {missing[0]!r} to score with "
                          "(--rerank-tokens YES,NO names two tokens of it)")
    return Scorer(mode, PoolingSpec("token_logits", token_ids=(ids[1], ids[0])), cfg.rerank_instruction)


def pair_prompts(s: Scorer, tokenizer, info: ExecutorInfo, queries: Sequence[str], documents: Sequence[str],
                 query_param: str, document_param: str) -> list[list[int]]:
    """One prompt per (queries[i], documents[i]); a prompt past the model's length names its document."""
    prompts = []
    for i, (q, d) in enumerate(zip(queries, documents)):
        ids = s.prompt(tokenizer, q, d)
        check_prompt(f"{document_param}.{i}", ids, info)
        prompts.append(ids)
    return prompts


def check_count(n: int, cfg: PoolingConfig, param: str) -> None:
    if not n:
        raise FieldError(param, "is empty: give at least one document")
    if n > cfg.max_inputs:
        raise FieldError(param, f"has {n} documents; this server scores at most {cfg.max_inputs} per request "
                         "(--max-embedding-inputs)")
