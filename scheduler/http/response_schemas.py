"""The JSON bodies of the OpenAI-compatible API's responses (pydantic): what the server writes, every field written
(unset ones as null). Separate from the request bodies (scheduler/http/request_schemas.py), which are validated
strictly; nothing here validates, and no model here is shared with a request.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Out(BaseModel):
    """A response body; every field is written, unset ones as null (as OpenAI writes "logprobs": null)."""


class PromptTokensDetails(Out):
    cached_tokens: int


class CompletionTokensDetails(Out):
    # OpenAI's names (from its Predicted Outputs): speculative-decoding drafts the model accepted / rejected.
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Out):
    content: list[TokenLogprobOut] | None = None
    refusal: list[TokenLogprobOut] | None = None


class CompletionLogprobs(Out):
    text_offset: list[int]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprobOut(Out):
    """One token of vLLM's prompt_logprobs entries: {token id: this}."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsOut = list[dict[str, PromptLogprobOut] | None]  # None first: the prompt's first token


class FunctionCallOut(Out):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    # The thinking of a reasoning model (--reasoning-parser): vLLM's reasoning_content, and since vLLM 0.11.1
    # `reasoning` (OpenAI's guidance for chat completions) with the same text; null without thinking.
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionCallDelta(Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string matched, or the stop token's id


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's, when the request set prompt_logprobs


class ChatDelta(Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # (as ChatMessageOut's)
    reasoning: str | None = None


class ChatChunkChoice(Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's, when the request set prompt_logprobs


class Completion(Out):
    """A whole completion, and (with stream) each chunk: OpenAI uses one shape for both."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str
    parent: str | None = None
    max_model_len: int
    deterministic: bool = False  # every executor serving runs --deterministic (docs/deterministic.md)


class ModelList(Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Out):
    prompt: str
