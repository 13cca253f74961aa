"""An OpenAI request -> tandem.generate.v1 GenerateRequest messages, the very input the gRPC servicer takes:
from there codec.request_from_pb tokenizes (chat template included) and validates exactly as for a gRPC
client, so both fronts generate the same text for the same request. Refuses here only what the proto cannot
express (suffix, ...), naming the field. echo with logprobs asks for the prompt's logprobs
(GenerateRequest.prompt_logprobs); max_tokens 0 (echo only) generates one token the renderer leaves out. Tool choices that call a function become constraints
(scheduler/http/tool_calls.py).

n > 1: the prompt is tokenized once and the domain request copied n times (GenerateRequest.choices()), with seed + i when a
seed is given so each choice is reproducible alone.
"""
from __future__ import annotations

import json
import re
from typing import Any

from scheduler.http import tool_calls, vllm_extras
from scheduler.http.errors import BadParameter
from scheduler.http.limits import HttpLimits
from scheduler.http.request_schemas import ChatCompletionRequest, ChatMessageIn, CompletionRequest, SamplingFields
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as pb

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples unless told otherwise (gRPC's unset is greedy)
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: "²".isdigit() is true and int() refuses it


def sampling(body: SamplingFields) -> cpb.SamplingParams:
    m = cpb.SamplingParams(
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0)
    if body.top_p is not None:
        m.top_p = body.top_p
    if body.seed is not None:
        m.seed = body.seed
    for key, bias in (body.logit_bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= 2**32:
            raise BadParameter("logit_bias", f"logit_bias keys must be token ids (decimal strings), got {key!r:.40}")
        m.logit_bias[int(key)] = bias
    return m


def stopping(body: SamplingFields, max_tokens: int | None) -> pb.StoppingCriteria:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return pb.StoppingCriteria(max_new_tokens=max_tokens or 0, min_new_tokens=body.min_tokens or 0, stop=stop,
                               stop_token_ids=body.stop_token_ids or [], ignore_eos=bool(body.ignore_eos),
                               include_stop_str_in_output=bool(body.include_stop_str_in_output))


def constraint(body: SamplingFields) -> pb.Constraint | None:
    """The structured-output constraint of response_format ("json_object", "json_schema"; "text" = none) or of
    vLLM's guided_json / guided_regex / guided_choice / guided_grammar; at most one of them."""
    given: list[tuple[str, pb.Constraint]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", pb.Constraint(json_object=pb.Constraint.JsonObject())))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise BadParameter("response_format.json_schema", "response_format of type \"json_schema\" needs "
                                   "json_schema.schema (the JSON Schema the output must follow)")
            given.append(("response_format", pb.Constraint(json_schema=json.dumps(rf.json_schema.schema_))))
        else:
            raise BadParameter("response_format", f"response_format {rf.type!r:.40} is not supported: \"text\", "
                               "\"json_object\" or \"json_schema\"")
    if body.guided_json is not None:
        schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        given.append(("guided_json", pb.Constraint(json_schema=schema)))
    if body.guided_regex is not None:
        given.append(("guided_regex", pb.Constraint(regex=body.guided_regex)))
    if body.guided_choice is not None:
        given.append(("guided_choice", pb.Constraint(choice=pb.Constraint.Choice(choices=body.guided_choice))))
    if body.guided_grammar is not None:
        given.append(("guided_grammar", pb.Constraint(grammar=body.guided_grammar)))
    if len(given) > 1:
        raise BadParameter(given[1][0], f"{' and '.join(name for name, _ in given)} each constrain the output: "
                           "give only one")
    return given[0][1] if given else None


_CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def param_names(body: SamplingFields) -> dict[str, str]:
    """This request's own names for the proto fields its errors may name, where they are not the usual ones
    (scheduler/http/errors.py): max_completion_tokens when sent, completions' `logprobs`, the guided_* field
    that carries the constraint."""
    names: dict[str, str] = {}
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        names["stopping.max_new_tokens"] = "max_completion_tokens"
    if isinstance(body, CompletionRequest):
        names["top_logprobs"] = "logprobs"
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name, None) is not None:
            names.update({"constraint": name, **{f"constraint.{k}": name for k in _CONSTRAINT_FIELDS}})
    return names


def _common(body: SamplingFields, adapter: str, top_logprobs: int, max_tokens: int | None) -> dict:
    return dict(sampling=sampling(body), stopping=stopping(body, max_tokens), adapter=adapter,
                top_logprobs=top_logprobs, keep_special_tokens=body.skip_special_tokens is False,
                constraint=constraint(body), cache_salt=body.cache_salt or "")


IMAGE_FIELD = "content[{j}].image_url"  # how an error about an image part names it (as the request wrote it)


def _text(i: int, m: ChatMessageIn) -> str:
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise BadParameter(f"messages.{i}.content.{j}", f"content parts of type {part.type!r:.40} are not "
                               "supported: this server takes text and image_url parts")
        texts.append(part.text)
    return "\n".join(texts)  # as vLLM joins text parts


def _parts(i: int, m: ChatMessageIn) -> list[pb.ContentPart]:
    """A content list with images, part for part (the template places each image among the text)."""
    out = []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            out.append(pb.ContentPart(text=part.text))
        elif part.type == "image_url":
            spec = part.image_url if isinstance(part.image_url, dict) else {"url": part.image_url}
            unknown = sorted(set(spec) - {"url", "detail"})
            if unknown:
                raise BadParameter(f"messages.{i}.content.{j}", f"messages[{i}].content[{j}].image_url: unknown field "
                                   f"{unknown[0][:40]!r} (image_url takes url and detail)")
            if spec.get("detail") not in (None, "auto", "low", "high"):
                raise BadParameter(f"messages.{i}.content.{j}", f"messages[{i}].content[{j}].image_url.detail must be "
                                   "auto, low or high (the model's processor decides the tiles whatever it says)")
            url = spec.get("url")
            if not isinstance(url, str) or not url:
                raise BadParameter(f"messages.{i}.content.{j}", f"messages[{i}].content[{j}].image_url: an image_url "
                                   "part needs image_url.url (a data: URL, or a file:// or http(s) URL the server "
                                   "is allowed to read)")
            out.append(pb.ContentPart(image=pb.ImageSource(url=url)))
        else:
            raise BadParameter(f"messages.{i}.content.{j}", f"content parts of type {part.type!r:.40} are not "
                               "supported: this server takes text and image_url parts")
    return out


def _message(i: int, m: ChatMessageIn) -> pb.ChatMessage:
    calls = [pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or []]
    msg = pb.ChatMessage(role=m.role, tool_calls=calls, tool_call_id=m.tool_call_id or "")
    if isinstance(m.content, list) and any(p.type == "image_url" for p in m.content):
        msg.parts.extend(_parts(i, m))
    else:
        msg.content = _text(i, m) if isinstance(m.content, list) else (m.content or "")
    return msg


def chat_messages(messages: list[ChatMessageIn], tools: list[pb.Tool] | None = None) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[_message(i, m) for i, m in enumerate(messages)], tools=tools or [])


def chat_request(body: ChatCompletionRequest, adapter: str,
                 auto: tool_calls.AutoTools | None = None) -> pb.GenerateRequest:
    """The request of a chat completion; with a tool choice that calls (tool_calls.tool_mode) the output is
    constrained to the call(s); with "auto" the model writes them in its own syntax (auto: this server's parser),
    its special tokens kept in the text when that syntax's markers are special tokens."""
    vllm_extras.check(body)
    if body.top_logprobs and not body.logprobs:
        raise BadParameter("top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    common = _common(body, adapter, body.top_logprobs or 0, max_tokens)
    mode = tool_calls.tool_mode(body, auto)
    if mode is not None and mode.auto is not None:
        common["keep_special_tokens"] |= mode.auto.keep_special_tokens
    elif mode is not None:
        if common["constraint"] is not None:
            raise BadParameter("tool_choice", "tool_choice makes the output a tool call and the request has another "
                               "constraint (response_format or guided_*): give only one")
        common["constraint"] = tool_calls.constraint(body, mode)
    return pb.GenerateRequest(messages=chat_messages(body.messages, tool_calls.tools_pb(body)),
                              prompt_logprobs=body.prompt_logprobs, **common)


_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt")  # variables the server sets itself


def template_variables(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's variables a request adds: chat_template_kwargs (vLLM's; e.g. enable_thinking) and
    reasoning_effort (OpenAI's, which gpt-oss templates read, as vLLM passes it)."""
    out = dict(body.chat_template_kwargs or {})
    for key in _TEMPLATE_OWN:
        if key in out:
            raise BadParameter(f"chat_template_kwargs.{key}", f"chat_template_kwargs cannot set {key!r}: the server "
                               "sets it from the request itself")
    if body.reasoning_effort is not None:
        out.setdefault("reasoning_effort", body.reasoning_effort)
    return out


def prompts(body: CompletionRequest, max_prompts: int = HttpLimits.max_prompts) -> list[str | list[int]]:
    """The prompts of a completion request: a string, strings, token ids, or lists of token ids; at most
    max_prompts of them (--max-prompts-per-request)."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise BadParameter("prompt", "prompt is empty")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if len(p) > max_prompts:
        raise BadParameter("prompt", f"prompt holds {len(p)} prompts; this server takes at most {max_prompts} per "
                           "request (--max-prompts-per-request): send them in several requests")
    return list(p)


def completion_requests(body: CompletionRequest, adapter: str,
                        max_prompts: int = HttpLimits.max_prompts) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt."""
    vllm_extras.check(body)
    if body.max_tokens == 0 and not body.echo:
        raise BadParameter("max_tokens", "max_tokens 0 generates nothing: it needs echo (the prompt back, with its "
                           "logprobs when logprobs is set), or ask for at least 1 token")
    if body.suffix:
        raise BadParameter("suffix", "suffix (insertion) is not supported by this server")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise BadParameter("best_of", "best_of other than n is not supported by this server")
    # max_tokens 0 (echo): one token is generated and left out of the response (render.py)
    common = _common(body, adapter, body.logprobs or 0, 1 if body.max_tokens == 0 else body.max_tokens)
    common["prompt_logprobs"] = completion_prompt_logprobs(body)
    out = []
    for p in prompts(body, max_prompts):
        if isinstance(p, str):
            out.append(pb.GenerateRequest(text=p, **common))
        else:
            out.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), **common))
    return out


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The alternatives per prompt token to ask for: echo with logprobs shows the prompt's tokens with logprobs
    alternatives (as OpenAI's legacy API and vLLM do); vLLM's prompt_logprobs asks on its own. None = neither."""
    asked = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    return max(asked) if asked else None


