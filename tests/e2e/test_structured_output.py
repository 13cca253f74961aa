"""Structured output on the default model through the full stack: JSON schemas (nested objects,
arrays, enums, bounded numbers, required/optional properties, $ref), regexes, choices and a Lark grammar,
greedy and sampled, every output valid; unconstrained requests in the same batch unchanged; greedy constrained
tokens equal to transformers' greedy decoding under the same llguidance masks; invalid constraints refused with
the library's message; the OpenAI front's response_format and guided_* extras, and its tool calls (a named
function's arguments and "required" calls validate, streamed as whole, the result answered in the next turn).

Schemas are bounded (maxLength, maxItems, enums, integer ranges) so that the grammar completes well within
max_new_tokens (an output cut by the length limit could not validate)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import re

import grpc
import httpx
import jsonschema
import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import DynamicCache

from scheduler.structured.constraint import TokenConstraint
from scheduler.structured.grammar import ConstraintKind, ConstraintSpec, GrammarCompiler
from scheduler.text.tokenizer import ChatMessage, ModelTokenizer
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as pb
from tandem.token_mask import mask_words
from tests.grpc_harness import start_for, start_scheduler_for
from tests.hf_reference import HfReference
from tests.scheduler_client import collect, rpc_error, wait_kv_free

pytestmark = pytest.mark.slow
MAX_NEW = 96

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}
SCHEMAS = {
    "nested": ("Give a person named Ann who lives in Paris as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name", "home"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "home": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                "properties": {"city": {"type": "string", "maxLength": 12},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
    "array_enum": ("List the colors of the French flag as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["colors"],
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "white", "blue", "green"]},
                                  "minItems": 1, "maxItems": 4}}}),
    "numbers": ("Describe an adult's age and a rating out of 5 as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["age", "rating"],
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "rating": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5}}}),
    "optional": ("Describe a cat as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": {"type": "string", "maxLength": 10}, "indoor": {"type": "boolean"},
                       "legs": {"type": "integer", "minimum": 0, "maximum": 4}}}),
    "ref": ("Give a line segment from (1, 2) to (3, 4) as JSON.", {
        "$defs": {"point": POINT}, "type": "object", "additionalProperties": False, "required": ["start", "end"],
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}}),
}
GREEDY = cpb.SamplingParams()
SAMPLED = cpb.SamplingParams(temperature=0.9, seed=1)
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
MOODS = ["positive", "negative", "neutral"]
LARK = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def stack(request, smollm2_dir):
    executor = start_for(request, smollm2_dir, "--kv-blocks", "256")
    return executor, start_scheduler_for(request, executor.address, "--http-port", "0")


def chat(question: str, constraint: pb.Constraint | None, sampling: cpb.SamplingParams = GREEDY,
         max_new: int = MAX_NEW, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)]),
                              stopping=kw.pop("stopping", None) or pb.StoppingCriteria(max_new_tokens=max_new),
                              sampling=sampling, constraint=constraint, **kw)


def run_all(stub, requests: list[pb.GenerateRequest]) -> list:
    with cf.ThreadPoolExecutor(len(requests)) as pool:  # concurrently: one batch on the executor
        return list(pool.map(lambda r: collect(stub, r), requests))


def test_json_schemas_greedy_and_sampled_outputs_validate(stack):
    executor, scheduler = stack
    cases = [(name, schema, s) for name, (_, schema) in SCHEMAS.items() for s in (GREEDY, SAMPLED)]
    results = run_all(scheduler.stub, [chat(SCHEMAS[name][0], pb.Constraint(json_schema=json.dumps(schema)), s)
                                       for name, schema, s in cases])
    for (name, schema, s), got in zip(cases, results):
        assert got.finish_reason == pb.FINISH_REASON_STOP, (name, s.seed, got.text)  # the grammar completed
        assert got.stop_reason == ""  # (not an EOS token: the constraint ended it)
        value = json.loads(got.text)
        jsonschema.validate(value, schema)
        assert got.usage.completion_tokens == len(got.token_ids) < MAX_NEW
    wait_kv_free(executor.stub)


def test_regex_choice_grammar_and_json_object_outputs_match(stack):
    _, scheduler = stack
    kinds = [("My phone number is", pb.Constraint(regex=PHONE), lambda t: re.fullmatch(PHONE, t)),
             ("Is 'I love it' positive, negative or neutral?", pb.Constraint(choice=pb.Constraint.Choice(
                 choices=MOODS)), lambda t: t in MOODS),
             ("What is 6 times 7?", pb.Constraint(grammar=LARK), lambda t: re.fullmatch(r"The answer is \d{1,3}\.", t)),
             ("Give a tiny JSON object with one key.", pb.Constraint(json_object=pb.Constraint.JsonObject()),
              lambda t: isinstance(json.loads(t), dict))]
    cases = [(q, c, check, s) for q, c, check in kinds for s in (GREEDY, SAMPLED)]
    results = run_all(scheduler.stub, [chat(q, c, s, max_new=40) for q, c, _, s in cases])
    for (q, c, check, s), got in zip(cases, results):
        assert check(got.text), (c.WhichOneof("kind"), s.seed, got.text)
        assert got.finish_reason == pb.FINISH_REASON_STOP


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(stack):
    _, scheduler = stack
    plain = [chat("Write a haiku about rain.", None, max_new=16),
             chat("Count to five.", None, cpb.SamplingParams(temperature=0.7, top_p=0.9, seed=6), max_new=16)]
    alone = run_all(scheduler.stub, plain)
    constrained = [chat(SCHEMAS[name][0], pb.Constraint(json_schema=json.dumps(SCHEMAS[name][1])))
                   for name in ("nested", "ref")]
    mixed = run_all(scheduler.stub, constrained[:1] + plain + constrained[1:])
    assert [m.token_ids for m in mixed[1:3]] == [a.token_ids for a in alone]
    assert [m.text for m in mixed[1:3]] == [a.text for a in alone]
    for m, a in zip(mixed[1:3], alone):  # (another batch shape rounds the matmuls differently: float noise only)
        assert [x.logprob for x in m.logprobs] == pytest.approx([x.logprob for x in a.logprobs], abs=1e-3)


def reference_greedy(hf: HfReference, grammars: GrammarCompiler, spec: ConstraintSpec, prompt: list[int],
                     max_new: int) -> list[int]:
    """transformers' greedy decoding under llguidance's masks (the same compiled grammar the scheduler uses)."""
    constraint = TokenConstraint(grammars.compile(spec))
    cache = DynamicCache()
    out = hf.model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    tokens: list[int] = []
    words = torch.zeros(mask_words(grammars.vocab_size), dtype=torch.int32)
    while len(tokens) < max_new:
        constraint.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
        logits = out.logits[0, -1].float()
        logits = logits.masked_fill(bits.flatten()[:logits.shape[0]] == 0, float("-inf"))
        tokens.append(int(logits.argmax()))
        if constraint.advance(tokens) or tokens[-1] in (2,):  # complete, or EOS where it may end
            break
        out = hf.model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_greedy_constrained_tokens_equal_transformers_under_the_same_masks(stack, smollm2_dir):
    _, scheduler = stack
    tok = ModelTokenizer(smollm2_dir)
    grammars = GrammarCompiler(tok, scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size, [2])
    hf = HfReference(smollm2_dir)
    question, schema = SCHEMAS["nested"]
    got = collect(scheduler.stub, chat(question, pb.Constraint(json_schema=json.dumps(schema))))
    prompt = tok.encode_chat([ChatMessage("user", question)])
    spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    assert got.token_ids == reference_greedy(hf, grammars, spec, prompt, MAX_NEW), got.text


def test_invalid_constraints_are_invalid_argument_with_the_library_message(stack):
    _, scheduler = stack
    for constraint, words in [(pb.Constraint(json_schema='{"type": "strin"}'), "strin"),
                              (pb.Constraint(json_schema="{not json"), "not valid JSON"),
                              (pb.Constraint(regex="[a-"), "unclosed character class"),
                              (pb.Constraint(grammar='start: "a" | b'), "unknown name"),
                              (pb.Constraint(choice=pb.Constraint.Choice()), "1 to 4096"),
                              (pb.Constraint(), "set one of")]:
        err = rpc_error(lambda: list(scheduler.stub.Generate(chat("hi", constraint))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()


def test_stop_strings_and_ignore_eos_with_a_constraint(stack):
    _, scheduler = stack
    got = collect(scheduler.stub, chat("Say hello.", pb.Constraint(regex="hello-world"),
                                       stopping=pb.StoppingCriteria(max_new_tokens=20, stop=["-"])))
    assert (got.text, got.finish_reason, got.stop_reason) == ("hello", pb.FINISH_REASON_STOP_SEQUENCE, "-")
    moods = pb.Constraint(choice=pb.Constraint.Choice(choices=MOODS))
    got = collect(scheduler.stub, chat("Mood?", moods, stopping=pb.StoppingCriteria(max_new_tokens=20,
                                                                                    ignore_eos=True)))
    assert got.text in MOODS and got.finish_reason == pb.FINISH_REASON_STOP  # complete: nothing may follow


def test_openai_response_format_and_guided_extras(stack):
    """(json_object's mapping is checked in tests/scheduler/test_http_convert.py, its output over gRPC above.)"""
    _, scheduler = stack
    client = OpenAI(base_url=f"{scheduler.process.http_url}/v1", api_key="none")
    question, schema = SCHEMAS["array_enum"]
    messages = [{"role": "user", "content": question}]
    resp = client.chat.completions.create(model="", messages=messages, max_tokens=MAX_NEW, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)
    assert resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model="", prompt="The mood of 'great!' is", max_tokens=8, n=2, seed=3,
                                     extra_body={"guided_choice": MOODS})
    assert all(c.text in MOODS for c in resp.choices)
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model="", messages=messages, max_tokens=8,
                                       extra_body={"guided_regex": "[a-"})
    assert "unclosed character class" in str(info.value)


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["tz"],
         "properties": {"tz": {"type": "string", "maxLength": 8}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]


def test_openai_tool_calls_named_and_required_whole_streamed_and_answered(stack):
    executor, scheduler = stack
    client = OpenAI(base_url=f"{scheduler.process.http_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice=named,
                                           max_tokens=MAX_NEW, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice=named,
                                                 max_tokens=MAX_NEW, temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    required = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice="required",
                                              max_tokens=MAX_NEW, temperature=0)
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), {"get_weather": WEATHER, "get_time": CLOCK}[c.function.name])

    # The agent loop's next turn: the call and its result go back in; tool_choice none answers in text.
    answer = client.chat.completions.create(
        model="", tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0,
        messages=messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    with pytest.raises(BadRequestError) as info:  # "auto" (the default with tools) would need a tool parser
        client.chat.completions.create(model="", messages=messages, tools=TOOLS, max_tokens=8)
    assert info.value.body["param"] == "tool_choice" and "not supported" in info.value.body["message"]
    wait_kv_free(executor.stub)


def test_a_tool_call_that_fails_or_is_abandoned_leaves_its_neighbours_and_the_kv_alone(stack):
    """Real processes: beside a plain chat stream, a tool-call request refused at validation (a choice naming
    no tool) fails alone, and a tool-call stream the client closes after its first deltas is aborted; the
    neighbour gets the tokens it gets alone and every KV block is free afterwards."""
    executor, scheduler = stack
    url = f"{scheduler.process.http_url}/v1/chat/completions"
    plain = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 48, "temperature": 0,
             "ignore_eos": True}
    alone = httpx.post(url, json=plain, timeout=120).json()["choices"][0]["message"]["content"]
    named = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": MAX_NEW,
             "temperature": 0, "stream": True}

    def neighbour() -> str:
        return httpx.post(url, json=plain, timeout=120).json()["choices"][0]["message"]["content"]

    cancelled = scheduler.stderr().count("cancelled by the client")
    with cf.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(neighbour)
        refused = httpx.post(url, json={**named, "stream": False, "tool_choice": {
            "type": "function", "function": {"name": "get_time_of_day"}}}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice.function.name"
        with httpx.Client(timeout=120) as http, http.stream("POST", url, json=named) as stream:
            chunks = (json.loads(line[len("data:"):]) for line in stream.iter_lines() if line.startswith("data: {"))
            first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"]["tool_calls"])
            assert first["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
        # leaving the block closed the connection mid-call
        assert beside.result(timeout=120) == alone
    wait_kv_free(executor.stub)
    assert scheduler.stderr().count("cancelled by the client") == cancelled + 1  # aborted, not run to its end
