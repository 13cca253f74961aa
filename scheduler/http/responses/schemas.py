"""The request body of POST /v1/responses (OpenAI's Responses API), validated as strictly as the chat route's
(scheduler/http/request_schemas.py: strict types, unknown fields refused naming them, valid Unicode, bounded
nesting). Input items are the ones a client sends and sends back: messages (text parts; an assistant's
output_text parts as a response gave them), function_call and function_call_output items, and reasoning items
(accepted back from a response's output, not shown to the template). The response side is
render.py (plain dicts in OpenAI's shape).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from scheduler.http.request_schemas import Count, Float, _Body

MAX_ITEMS = 4096  # input items of one request (as chat messages: codec.MAX_CHAT_MESSAGES)


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class OutputText(_Body):
    """An assistant message's text part, as a response's output gave it (sent back as input)."""
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(_Body):
    """An image part (a vision-language model): image_url is a data: URL (or a file:// / http(s) URL the server
    may read: docs/models.md#vision-language-models-images-in-text-out). file_id is not served; detail only
    "auto" (the model's processor decides the tiles)."""
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto"] | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText | InputImage]
    id: str | None = None  # (a response's own output item, sent back)
    status: str | None = None


class FunctionCallItem(_Body):
    """A call the model made (a response's output item, sent back with the next turn)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """The result of a call, for the model's next turn."""
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Body):
    """A response's reasoning item sent back: accepted, not shown to the template (as templates drop earlier
    turns' thinking)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    """An input item's kind: its `type` ("message" when left out, as OpenAI's easy input messages do)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _TAGS.get(kind)  # (None: refused as no kind of item)


# Tagged by `type`, so that a bad item is refused for its own fields (input.0.output), not for every kind's;
# the tags are the class names, which error paths leave out (errors.validation_param)
_TAGS = {"message": "MessageItem", "function_call": "FunctionCallItem",
         "function_call_output": "FunctionCallOutputItem", "reasoning": "ReasoningItem"}
InputItem = Annotated[Annotated[MessageItem, Tag("MessageItem")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
                      | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
                      | Annotated[ReasoningItem, Tag("ReasoningItem")], Discriminator(_item_type)]


class FunctionTool(_Body):
    """A function the model may call, in the Responses API's flat shape."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: the schema is always enforced when a call is forced


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # (json_schema: names the schema, otherwise unused)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # accepted: the schema is always enforced


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, unused (no such switch in templates)


class ReasoningConfig(_Body):
    # effort: passed to the chat template as reasoning_effort (gpt-oss templates read it; others ignore it)
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    # summary: the reasoning parser's text is the reasoning item's content; no separate summary is written
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (its older name)


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem] = Field(max_length=MAX_ITEMS)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None  # unset: "auto" with tools
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Count | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: bool | None = None
    store: bool | None = None  # unset = true: kept for previous_response_id (--responses-store-size)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None  # accepted, unused
    truncation: Literal["disabled"] | None = None  # "auto" (dropping input to fit) is not served
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat completions
