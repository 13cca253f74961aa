"""Hypothesis strategies for the HTTP front's bodies: valid requests (chat completions, completions, tokenize,
detokenize) whose fields are, at random, left out or valid values kept small (few tokens, few choices: the
examples run on real servers), then, in two thirds of them, one to three nasty values put in at random paths
— a field of the body, or anything inside one: integers at and past every wire range, floats that are inf,
NaN or past float32, lone surrogates and odd Unicode, values of the wrong type, deep nesting, any JSON — and
raw HTTP/1.1 requests with odd methods, targets, headers and bodies."""
from __future__ import annotations

import json

from hypothesis import strategies as st

Json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)

_EDGES = [-(2**63), -1, 0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
          10**30, 10**400]
NASTY_INT = st.sampled_from(_EDGES) | st.integers()
NASTY_FLOAT = st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 3.5e38, -3.5e38, 5e-324,
                               -0.0]) | st.floats()
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ODD_TEXT = st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "\udbff\udfff", "\u202e\u200b\ufeff", "\U0010ffff",
                            "🙂" * 50, "\r\n\r\n", "x" * 5000, "null", "{}", "\\u0000"]) \
    | st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12) \
    | st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), SURROGATE, st.text(max_size=4))
DEEP = st.integers(min_value=1, max_value=130).map(lambda d: json.loads("[" * d + "]" * d)) \
    | st.integers(min_value=1, max_value=130).map(lambda d: json.loads('{"a":' * d + "1" + "}" * d))
WRONG = st.none() | st.booleans() | st.lists(st.integers(), max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                                          st.integers(), max_size=2)
NASTY = NASTY_INT | NASTY_FLOAT | ODD_TEXT | WRONG | DEEP | Json
TEXT = st.text(max_size=20)
TOKEN = st.integers(min_value=0, max_value=100)  # ids of the tiny model's vocabulary


def _set_at(draw, node: object, names: list[str]) -> object:
    """node with a nasty value at a path drawn at random: a field of its own (names: ones it may lack), or one
    inside a dict or list it holds, however deep."""
    if isinstance(node, (dict, list)) and node and draw(st.booleans()):  # go down
        key = draw(st.sampled_from(sorted(node)) if isinstance(node, dict) else st.integers(0, len(node) - 1))
        node[key] = _set_at(draw, node[key], [])
        return node
    if isinstance(node, dict):
        key = draw(st.sampled_from(names) if names else st.text(max_size=6)) if not node or draw(st.booleans()) \
            else draw(st.sampled_from(sorted(node)))
        node[key] = draw(NASTY)
        return node
    return draw(NASTY)


@st.composite
def _mutated(draw, valid: st.SearchStrategy, names: list[str]) -> dict:
    """A valid body (a third of the time) or one with one to three nasty values put in at random paths."""
    body = draw(valid)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        body = _set_at(draw, body, names)
    return body


def _stop() -> st.SearchStrategy:
    word = st.text(min_size=1, max_size=8)
    return word | st.lists(word, max_size=3)


def _sampling() -> dict[str, st.SearchStrategy]:
    """The optional fields chat and completions share, valid (small: few tokens, few choices)."""
    return {
        "model": st.sampled_from(["", "", "", "nope"]),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "n": st.integers(1, 3),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "stop": _stop(),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
        "seed": st.integers(0, 2**64 - 1),
        "user": TEXT,
        "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(0.5, 2),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(TOKEN, max_size=3),
        "skip_special_tokens": st.booleans(),
        "return_tokens_as_token_ids": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
        | st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                    st.just({"type": "object"}) | Json),
        "guided_regex": st.sampled_from(["[a-z]+", "(a|b)*c", "[", "\\d{1,3}"]),
        "guided_choice": st.lists(TEXT, max_size=3),
    }


def _message() -> st.SearchStrategy:
    content = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
    return st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": content},
                                 optional={"name": TEXT})


def _tools() -> st.SearchStrategy:
    function = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f"])},
                                     optional={"description": TEXT, "parameters": st.just(
                                         {"type": "object", "properties": {"city": {"type": "string"}}}) | Json})
    return st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": function}), max_size=2)


def chat_bodies() -> st.SearchStrategy:
    optional = {**_sampling(), "max_completion_tokens": st.integers(1, 4), "logprobs": st.booleans(),
                "top_logprobs": st.integers(0, 5), "tools": _tools(),
                "tool_choice": st.sampled_from(["none", "auto", "required"])}
    required = {"messages": st.lists(_message(), min_size=1, max_size=3), "max_tokens": st.integers(1, 4)}
    return _mutated(st.fixed_dictionaries(required, optional=optional), [*required, *optional])


def completion_bodies() -> st.SearchStrategy:
    prompt = TEXT | st.lists(TEXT, min_size=1, max_size=3) | st.lists(TOKEN, min_size=1, max_size=8) \
        | st.lists(st.lists(TOKEN, min_size=1, max_size=4), min_size=1, max_size=3) \
        | st.sampled_from([64, 65]).map(lambda k: ["hi"] * k)  # at --max-prompts-per-request and past it
    optional = {**_sampling(), "logprobs": st.integers(0, 5), "echo": st.booleans(),
                "suffix": TEXT, "best_of": st.integers(1, 3)}
    required = {"prompt": prompt, "max_tokens": st.integers(1, 4)}  # always: the default is 256 tokens
    return _mutated(st.fixed_dictionaries(required, optional=optional), [*required, *optional])


def tokenize_bodies() -> st.SearchStrategy:
    common = {"return_token_strs": st.booleans(), "model": st.just("")}
    prompt = st.fixed_dictionaries({"prompt": TEXT}, optional={"add_special_tokens": st.just(True), **common})
    chat = st.fixed_dictionaries({"messages": st.lists(_message(), min_size=1, max_size=3)},
                                 optional={"tools": _tools(), "add_generation_prompt": st.just(True), **common})
    names = ["prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt", *common]
    return _mutated(prompt | chat, names)


def detokenize_bodies() -> st.SearchStrategy:
    return _mutated(st.fixed_dictionaries({"tokens": st.lists(TOKEN, max_size=8)}, optional={"model": TEXT}),
                    ["tokens", "model"])


ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health",
          "/v1/models/x", "/metrics", "/nope"]
_HEADER_NAMES = [b"content-type", b"content-length", b"transfer-encoding", b"authorization", b"connection",
                 b"expect", b"host", b"origin", b"x-\xff", b"", b" bad", b"content-type:"]


@st.composite
def raw_requests(draw) -> bytes:
    """A raw request: a method, a target, headers (names and values odd or not) and a body, its Content-Length
    right unless the headers drawn say otherwise; or bytes that are not HTTP at all."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=512)) + b"\r\n\r\n"
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"OPTIONS", b"HEAD", b"G\x00T", b"post"])
                  | st.binary(min_size=1, max_size=6))
    target = draw(st.sampled_from([r.encode() for r in ROUTES]) | st.binary(max_size=30)
                  | st.sampled_from([b"/v1/models/%ED%A0%80", b"/v1/models/%00", b"*", b"http://x/health",
                                     b"/" + b"a" * 9000]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x", b""]))
    body = draw(st.binary(max_size=256) | st.builds(lambda b: json.dumps(b).encode(), completion_bodies())
                | st.builds(lambda b: json.dumps(b).encode(), Json))
    headers = draw(st.lists(st.tuples(st.sampled_from(_HEADER_NAMES) | st.binary(max_size=12),
                                      st.binary(max_size=40)
                                      | st.sampled_from([b"application/json", b"chunked", b"-1", b"99999999999999999",
                                                         b"100-continue", b"close", b"Bearer \xff"])),
                            max_size=5))
    names = {name.lower() for name, _ in headers}
    if b"content-length" not in names and b"transfer-encoding" not in names:
        headers.append((b"content-length", str(len(body)).encode()))
    if b"host" not in names:
        headers.append((b"host", b"x"))
    head = method + b" " + target + b" " + version + b"\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    return head + b"\r\n" + body
