"""Each reasoning parser on its family's output shapes: the whole split, and the same text streamed split at
every boundary (two deltas at every position, and one character per delta) gives the same reasoning and
content; markers that are not whole are held back; the registry's choice by family, and its refusals."""
from __future__ import annotations

import pytest

from scheduler.reasoning.gpt_oss import GptOssParser
from scheduler.reasoning.parser import ReasoningParser, Split
from scheduler.reasoning.registry import choose, guess
from scheduler.reasoning.think_tags import DeepSeekR1Parser, Qwen3Parser, SmolLM3Parser

VOCAB = {"<think>": 10, "</think>": 11, "<|channel|>": 20, "<|message|>": 21, "<|end|>": 22, "<|start|>": 23,
         "final": 24}


def encode(text: str) -> list[int]:
    """A toy tokenizer: markers are one token each, every other character one token."""
    ids, i = [], 0
    while i < len(text):
        for marker, token in VOCAB.items():
            if text.startswith(marker, i):
                ids.append(token)
                i += len(marker)
                break
        else:
            ids.append(1000 + ord(text[i]))
            i += 1
    return ids


THINK_CASES = [  # (output, thinking at start, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False, "\nLet me see.\n", "The answer is 4."),
    ("  <think>hm</think>ok", False, "hm", "ok"),
    ("No thinking here.", False, None, "No thinking here."),
    ("<thinking is a word", False, None, "<thinking is a word"),
    ("<think>cut before the end", False, "cut before the end", None),
    ("<think>a</think>", False, "a", None),
    ("<think></think>\n\n", False, "", None),
    ("Let me see.</think>\n\n{\"x\": 1}", True, "Let me see.", "{\"x\": 1}"),
    ("a < b and </thin k> is not it</think>yes", True, "a < b and </thin k> is not it", "yes"),
    ("still thinking </th", True, "still thinking </th", None),
    ("answer </think> again", False, None, "answer </think> again"),
    ("", False, None, ""),
    ("<thi", False, None, "<thi"),
]


def streamed(parser: ReasoningParser, deltas: list[str], thinking: bool) -> tuple[str, str]:
    stream = parser.stream(thinking)
    reasoning = content = ""
    for d in deltas:
        piece = stream.feed(d)
        reasoning, content = reasoning + piece.reasoning, content + piece.content
    piece = stream.finish()
    return reasoning + piece.reasoning, content + piece.content


def check_every_boundary(parser: ReasoningParser, text: str, thinking: bool, want: Split) -> None:
    assert parser.split(text, thinking) == want
    flat = (want.reasoning or "", want.content or "")
    assert streamed(parser, [text], thinking) == flat
    assert streamed(parser, list(text), thinking) == flat, "one character per delta"
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]], thinking) == flat, f"split at {cut}: {text[:cut]!r}"
    for a in range(0, len(text) + 1, 3):  # three deltas, an empty one among them
        assert streamed(parser, [text[:a], "", text[a:a + 5], text[a + 5:]], thinking) == flat


@pytest.mark.parametrize("parser_class", [Qwen3Parser, SmolLM3Parser, DeepSeekR1Parser])
@pytest.mark.parametrize("text, thinking, reasoning, content", THINK_CASES)
def test_think_tags_whole_equals_streamed_at_every_boundary(parser_class, text, thinking, reasoning, content):
    check_every_boundary(parser_class(encode), text, thinking, Split(reasoning, content))


def test_a_stream_holds_back_a_split_end_tag_until_it_is_whole():
    stream = Qwen3Parser(encode).stream(thinking=True)
    assert stream.feed("plan </th").reasoning == "plan "
    piece = stream.feed("ink>\n\nDone")
    assert (piece.reasoning, piece.content) == ("", "Done")
    stream = Qwen3Parser(encode).stream(thinking=False)
    assert stream.feed(" <th") == type(stream.feed(""))()  # nothing said while the start tag may come
    assert stream.feed("ink>x").reasoning == "x"


def test_where_the_output_starts_comes_from_the_prompt():
    qwen, r1 = Qwen3Parser(encode), DeepSeekR1Parser(encode)
    opened = encode("<|im_start|>assistant\n<think>\n")
    closed = encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    plain = encode("<|im_start|>assistant\n")
    assert qwen.opens_thinking(opened) and not qwen.opens_thinking(plain) and not qwen.opens_thinking(closed)
    assert r1.opens_thinking(opened) and r1.opens_thinking(plain) and not r1.opens_thinking(closed)
    assert qwen.prompt_ended_thinking(closed) and not qwen.prompt_ended_thinking(plain)
    assert qwen.answer_marker == (VOCAB["</think>"],)


HARMONY_CASES = [  # (output, reasoning, content)
    ("<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4",
     "User asks 2+2.", "4"),
    ("<|channel|>analysis<|message|>thinking, cut", "thinking, cut", None),
    ("plain text, no channels", None, "plain text, no channels"),
    ("<|channel|>final<|message|>only an answer<|return|>", None, "only an answer"),
    ("<|channel|>analysis<|message|>a < b<|end|><|start|>assistant<|channel|>commentary to=functions.f "
     "<|constrain|>json<|message|>{\"x\": 1}<|call|>", "a < b", "{\"x\": 1}"),
]


@pytest.mark.parametrize("text, reasoning, content", HARMONY_CASES)
def test_gpt_oss_channels_whole_equals_streamed_at_every_boundary(text, reasoning, content):
    check_every_boundary(GptOssParser(encode), text, False, Split(reasoning, content))


def test_gpt_oss_answer_marker_is_the_final_channel():
    assert GptOssParser(encode).answer_marker == tuple(encode("<|channel|>final<|message|>"))


QWEN3_TEMPLATE = ("{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                  "{% endif %}")


def test_registry_guesses_by_family_and_refuses_what_cannot_run():
    assert guess("Qwen3ForCausalLM", QWEN3_TEMPLATE) == "qwen3"
    assert guess("LlamaForCausalLM", "{{ '<｜Assistant｜><think>\\n' }}") == "deepseek_r1"
    assert guess("SmolLM3ForCausalLM", "/no_think ... <think>") == "smollm3"
    assert guess("GptOssForCausalLM", None) == "gpt_oss"
    assert guess("LlamaForCausalLM", "{{ messages }}") is None
    assert isinstance(choose("auto", "Qwen3ForCausalLM", QWEN3_TEMPLATE, encode), Qwen3Parser)
    assert choose("none", "Qwen3ForCausalLM", QWEN3_TEMPLATE, encode) is None
    assert isinstance(choose("deepseek_r1", "LlamaForCausalLM", None, encode), DeepSeekR1Parser)

    def chars(text: str) -> list[int]:  # a vocabulary without the markers as tokens
        return [ord(c) for c in text]

    assert choose("auto", "Qwen3ForCausalLM", QWEN3_TEMPLATE, chars) is None  # guessed: left off
    with pytest.raises(ValueError, match="'<think>' is not one token"):
        choose("qwen3", "Qwen3ForCausalLM", QWEN3_TEMPLATE, chars)
    with pytest.raises(ValueError, match="not known"):
        choose("granite9", "X", None, encode)
