"""Embedding inputs -> pooled GenerateRequests: each input (a text, or token ids) checked and tokenized, its
pooling resolved from what the executor's model offers (PoolingFacts), and made a request of its own in the
scheduler's queue. Errors name the field and the input's index (`input.3`), for HTTP and gRPC alike."""
from __future__ import annotations

import uuid
from typing import Sequence

from scheduler.executor.info import ExecutorInfo, PoolingFacts
from scheduler.request import GenerateRequest, PoolingSpec, StoppingCriteria
from tandem.capabilities import POOLING
from tandem.errors import InvalidRequest, Unsupported

POOLED_STOPPING = StoppingCriteria(max_new_tokens=1)  # (admission counts prompt + 1: a pooled item samples none)


class FieldError(InvalidRequest):
    """A bad input field: names it (`param`, as the HTTP front's errors carry it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def pooling_facts(info: ExecutorInfo) -> PoolingFacts:
    """What the serving executors offer, or Unsupported naming why there is nothing."""
    if POOLING not in info.capabilities or info.pooling is None:
        raise Unsupported("no serving executor computes embeddings or scores (capability 'pooling'): an executor "
                          "older than this feature, or one started with --deterministic or --tensor-parallel-size > 1 "
                          "(which keep no hidden states); serve the model on an executor without them")
    return info.pooling


def embed_spec(info: ExecutorInfo) -> PoolingSpec:
    """The model's embedding pooling (the executor's --pooling, else its checkpoint's), normalised."""
    facts = pooling_facts(info)
    if facts.default_type is None:
        raise Unsupported(f"model {info.model_id!r} asks for a pooling this server does not compute ({facts.source}); "
                          "start the executor with --pooling last or --pooling mean")
    return PoolingSpec("embed", facts.default_type, normalize=True)


def request_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


def pooled_request(rid: str, prompt_ids: Sequence[int], spec: PoolingSpec, adapter: str = "") -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt_ids), POOLED_STOPPING, adapter=adapter, pooling=spec)


def check_prompt(param: str, ids: Sequence[int], info: ExecutorInfo) -> None:
    """A prompt to pool: not empty, every id in the vocabulary, within the model's length."""
    if not ids:
        raise FieldError(param, "is empty (it tokenizes to no tokens)")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise FieldError(param, f"token id {bad} is out of range: the vocabulary has {info.vocab_size} tokens")
    if len(ids) > info.max_seq_len:
        raise FieldError(param, f"has {len(ids)} tokens; the model takes at most {info.max_seq_len} (shorten it)")


def embed_prompts(inputs: Sequence[str | Sequence[int]], tokenizer, info: ExecutorInfo, max_inputs: int,
                  max_chars: int, param: str = "input") -> list[list[int]]:
    """Each input's token ids (texts tokenized with the special tokens the tokenizer adds; ids as given)."""
    if not inputs:
        raise FieldError(param, "has no inputs: give a string, a list of strings or token ids")
    if len(inputs) > max_inputs:
        raise FieldError(param, f"has {len(inputs)} inputs; this server takes at most {max_inputs} per request "
                         "(--max-embedding-inputs): send them in several requests")
    prompts = []
    for i, item in enumerate(inputs):
        where = f"{param}.{i}" if len(inputs) > 1 or not isinstance(item, str) else param
        if isinstance(item, str):
            if not item:
                raise FieldError(where, "is an empty string")
            if len(item) > max_chars:
                raise FieldError(where, f"has {len(item)} characters; at most {max_chars} (--max-prompt-chars)")
            ids = tokenizer.encode(item)
        else:
            ids = list(item)
        check_prompt(where, ids, info)
        prompts.append(ids)
    return prompts
