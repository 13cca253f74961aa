"""The JSON bodies of the OpenAI-compatible API's requests (pydantic), validated strictly. Separate from the
response bodies (scheduler/http/response_schemas.py): these decide what a client may send and how it is refused;
those only write what the server answers.

Requests are validated strictly (a string where a number belongs is refused, never coerced: 400 naming the
field) and unknown fields are refused (400 naming the field), at every level: a field this server does not
serve would otherwise be dropped silently and the client would get results it did not ask for (vLLM's
`use_beam_search`, OpenAI's `audio`, ...). What clients send back unchanged from a response they got (an
assistant message's `refusal`, `annotations`, null `audio`/`function_call`, a content part's media it cannot
use) is named here so that it gets the precise answer. Every optional field also takes JSON null. Value ranges
that the scheduler's own validation already checks (temperature, top_p, penalties, logit_bias values, stop
strings, token ids against the vocabulary) are left to it, so HTTP and gRPC clients get the same messages;
the bounds here are those the proto cannot carry (every integer has its wire type's range: uint32 counts,
uint64 seed; floats are finite float32s) or that only HTTP has (n).

Every string of a request body, however deep (message contents, names, stop strings, tool and response_format
schemas, dict keys), must be valid Unicode: JSON can escape a lone UTF-16 surrogate ("\\ud800"), which no
UTF-8 encoder (protobuf, the tokenizer) takes. One validator on the base class refuses it for every field,
naming the field (400), before anything is converted; the same validator bounds how deep free-form JSON
values (schemas, tool parameters) nest (MAX_DEPTH).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tandem.sampling_params import MAX_TOP_LOGPROBS

MAX_N = 16  # choices per request (n): each is a request of its own in the scheduler's queue
UINT32_MAX = 2**32 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]  # uint32 on the wire; < vocab_size is checked by the scheduler
Count = Annotated[int, Field(ge=1, le=UINT32_MAX)]  # a uint32 number of tokens, at least 1
FLOAT32_MAX = 3.4028234663852886e38
# float on the wire: finite (1e999 parses as inf) and within float32's range, refused here naming the field
Float = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
MAX_REQUEST_ID = 256  # characters of vLLM's request_id
MAX_DEPTH = 64  # levels of nesting of a free-form JSON value (a schema, tool parameters): llguidance takes 128


def _fault(value: Any, path: str = "", depth: int = 0) -> tuple[str, str] | None:
    """(path, "surrogate" or "depth") of the first string in value, a dict key included, that is not valid
    Unicode (a lone surrogate), or of the first value nested past MAX_DEPTH; None if there is none. path: ""
    = the value itself, ".2", ".key", ... Models inside were checked by their own validator."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "surrogate"
        return None
    if isinstance(value, (dict, list)) and depth >= MAX_DEPTH:
        return path, "depth"
    if isinstance(value, dict):
        for k, v in value.items():
            found = _fault(k, f"{path}.{k!r:.40}") if isinstance(k, str) else None
            found = found or _fault(v, f"{path}.{k:.40}", depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not isinstance(v, (int, float, bool)) and (found := _fault(v, f"{path}.{i}", depth + 1)) is not None:
                return found
    return None


_FAULTS = {"surrogate": ("string_unicode", "a string{at} holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                                           "without its pair): strings must be valid Unicode"),
           "depth": ("json_depth", f"a value{{at}} is nested more than {MAX_DEPTH} levels deep, this server's limit")}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _plain_values(cls, value: Any) -> Any:
        fault = _fault(value)
        if fault is not None:
            where, kind = fault
            error_type, template = _FAULTS[kind]
            raise PydanticCustomError(error_type, template, {"at": f" (at {where.lstrip('.')[:120]})" if where else ""})
        return value


class ContentPart(_Body):
    type: str  # only "text" is served
    text: str | None = None
    # media parts: named so that their type gets the precise refusal (convert.py), not "unknown field"
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCallIn(_Body):
    name: str
    arguments: str  # JSON text, as the response that made the call gave it


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Body):
    role: str
    content: str | list[ContentPart] | None = None  # null: an assistant turn that only called tools
    name: str | None = None  # accepted, not passed to the template
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls (passed to the template)
    tool_call_id: str | None = None  # a "tool" turn: the call it answers
    # what the openai package sends back when a response's message is appended to the next request's
    # messages: response-only metadata, not passed to the template
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None  # (audio output is never produced, so a real one cannot come back)
    function_call: None = None  # (the legacy functions API is not served: only null comes back)
    reasoning_content: str | None = None  # vLLM's reasoning field, as its responses carry it
    reasoning: str | None = None  # (its newer name, vLLM >= 0.11.1)


class FunctionIn(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON Schema; unset = no arguments
    strict: bool | None = None  # accepted: the schema is always enforced when the function must be called


class ToolIn(_Body):
    type: Literal["function"]
    function: FunctionIn


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Body):
    include_usage: bool | None = None
    # vLLM's: every chunk also carries its choice's usage so far (scheduler/http/render.py)
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Body):
    name: str | None = None  # OpenAI requires it; it names the schema and is otherwise unused
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Body):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body):
    """What chat and text completions share: the model, sampling, stopping, n, streaming; vLLM's extras."""
    model: str | None = None  # the base model id or an adapter name; unset or "" = the base model
    max_tokens: Count | None = None
    temperature: Float | None = None  # unset = 1.0, as OpenAI
    top_p: Float | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None  # token id (as a string, as JSON keys are) -> bias
    seed: int | None = Field(None, ge=0, lt=2**64)
    user: str | None = None  # accepted, unused
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, le=UINT32_MAX)  # -1 or 0 = off
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: int | None = Field(None, ge=0, le=UINT32_MAX)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # unset = true
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    # structured output: OpenAI's response_format (chat; completions too, as vLLM), vLLM's guided_* extras
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM 0.10.1.1's other extras (scheduler/http/vllm_extras.py: accepted where they change nothing or are
    # served, else refused naming why); request_id: the response's id after its "chatcmpl-" / "cmpl-"
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID)] | None = None
    priority: int | None = Field(None, ge=-2**63, lt=2**63)
    use_beam_search: bool | None = None
    length_penalty: Float | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=UINT32_MAX)
    allowed_token_ids: list[TokenId] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None
    cache_salt: Annotated[str, Field(max_length=256)] | None = None  # prefix cache and drafts per salt
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: the response's prompt_logprobs
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # unset: "auto" with tools
    parallel_tool_calls: bool | None = None  # with "required": false = exactly one call
    # more variables for the chat template (vLLM's), e.g. {"enable_thinking": false} for Qwen3 / SmolLM3
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None  # vLLM's: false leaves the reasoning out (unset = true)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # OpenAI's: the template's reasoning_effort
    # vLLM 0.10.1.1's chat extras (scheduler/http/vllm_extras.py)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    bad_words: list[str] | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structural_tag: str | None = None
    # SGLang's, sent by vllm-router 0.1.17 on every chat request (scheduler/http/vllm_extras.py)
    no_stop_trim: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    return_hidden_states: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None  # the prompt (text, and with logprobs its tokens' logprobs) before the output
    max_tokens: int | None = Field(None, ge=0, le=UINT32_MAX)  # 0: only with echo (the prompt alone back)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: each choice's prompt_logprobs
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # only best_of == n is served
    add_special_tokens: bool | None = None  # vLLM's (default true: as text prompts are encoded)
    prompt_embeds: Any = None  # vLLM's, refused (scheduler/http/vllm_extras.py)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolIn] | None = None  # with messages: for the chat template, as in a chat completion
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
