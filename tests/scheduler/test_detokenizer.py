"""scheduler.output.detokenizer.IncrementalDetokenizer with SmolLM2's byte-level BPE tokenizer (multi-byte characters
are split across tokens)."""
from __future__ import annotations

import random

import pytest

from scheduler.output.detokenizer import IncrementalDetokenizer
from scheduler.text.tokenizer import ChatMessage

REPLACEMENT = "\ufffd"
IM_END = 2  # <|im_end|> in SmolLM2

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, déjà vu, Ångström",
    "日本語のテキストと中文文本",
    "🙂🚀 ok 👍🏽!",
    "👨‍👩‍👧 family",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
    "mixed: a日b🙂c é\n\t🚀",
    "  leading and trailing  ",
    "line one\nline two\n\n",
    "def add(a, b):\n    return a + b\n",
    "Ελληνικά и кириллица, עברית, العربية",
]


def _stream(tok, prompt_ids, output_ids, skip=True) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in output_ids]
    return deltas, detok.flush(), detok


def test_texts_split_multibyte_characters(tok):
    # The test is only meaningful if some tokens are partial characters on their own.
    partial = [t for text in TEXTS for t in tok.encode(text) if tok.decode([t]) == REPLACEMENT]
    assert len(partial) > 10


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_reproduces_decode(tok, text):
    ids = tok.encode(text)
    full = tok.decode(ids)
    assert full == text
    deltas, tail, detok = _stream(tok, [], ids)
    assert "".join(deltas) + tail == full
    assert detok.text == full
    for d in deltas:
        assert REPLACEMENT not in d
    assert REPLACEMENT not in tail


@pytest.mark.parametrize("text", TEXTS)
def test_emitted_text_is_always_a_prefix(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    emitted = ""
    for k, t in enumerate(ids, 1):
        emitted += detok.add(t)
        assert text.startswith(emitted)
        assert detok.text == emitted
        # nothing complete is held back for long: what is missing is at most the partial character
        assert len(tok.decode(ids[:k]).rstrip(REPLACEMENT)) >= len(emitted)
    # a well-formed text is fully out without needing flush
    assert emitted == text
    assert detok.flush() == ""


def test_flush_on_empty_and_twice(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert detok.flush() == ""
    assert detok.add(tok.encode(" there")[0]) == " there"
    assert detok.flush() == ""
    assert detok.flush() == ""


def test_flush_releases_incomplete_character(tok):
    ids = tok.encode("🙂")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[0]) == ""
    tail = detok.flush()
    assert tail == tok.decode(ids[:1])
    assert REPLACEMENT in tail


@pytest.mark.parametrize("prompt, output", [
    ("Hello", " world, how are you? 🙂"),
    ("The answer is", " 42."),
    ("Translate: 日本", "語 means Japanese"),
    ("Say hi:", "  two spaces first"),
    ("Line\n", "\nnext line"),
])
def test_with_prompt_context(tok, prompt, output):
    prompt_ids = tok.encode(prompt)
    output_ids = tok.encode(output)
    full = tok.decode(output_ids)
    assert full == output
    deltas, tail, _ = _stream(tok, prompt_ids, output_ids)
    assert "".join(deltas) + tail == full
    assert all(REPLACEMENT not in d for d in deltas)


def test_first_output_token_keeps_its_leading_space(tok):
    prompt_ids = tok.encode("Hello")
    output_ids = tok.encode(" world")
    assert len(output_ids) == 1 and tok.decode(output_ids).startswith(" ")
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert detok.add(output_ids[0]) == " world"


def test_with_chat_prompt_context(tok):
    prompt_ids = tok.encode_chat([ChatMessage("user", "Hi")])
    output_ids = tok.encode("Hello! How can I help you today? 😊") + [IM_END]
    deltas, tail, _ = _stream(tok, prompt_ids, output_ids)
    assert "".join(deltas) + tail == tok.decode(output_ids) == "Hello! How can I help you today? 😊"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    output_ids = tok.encode("Hi") + [IM_END] + tok.encode(" there 🙂") + [IM_END]
    full = tok.decode(output_ids, skip_special_tokens=skip)
    deltas, tail, _ = _stream(tok, tok.encode("Prompt"), output_ids, skip=skip)
    assert "".join(deltas) + tail == full
    if skip:
        assert full == "Hi there 🙂"
        assert "<|im_end|>" not in "".join(deltas)
    else:
        assert full == "Hi<|im_end|> there 🙂<|im_end|>"
        assert deltas[-1] == "<|im_end|>"  # the special token's text comes out with it
    assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_token_first_and_in_prompt(tok, skip):
    prompt_ids = [1] + tok.encode("user\nHi") + [IM_END]  # prompt context ends in a special token
    output_ids = [1] + tok.encode("assistant\nYes 🙂")
    full = tok.decode(output_ids, skip_special_tokens=skip)
    deltas, tail, _ = _stream(tok, prompt_ids, output_ids, skip=skip)
    assert "".join(deltas) + tail == full


@pytest.mark.parametrize("seed", range(6))
def test_random_concatenations_of_texts(tok, seed):
    rng = random.Random(seed)
    pieces = [rng.choice(TEXTS) for _ in range(4)]
    text = "".join(pieces)
    ids = tok.encode(text)
    prompt_ids = tok.encode(rng.choice(TEXTS))
    deltas, tail, _ = _stream(tok, prompt_ids, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert all(REPLACEMENT not in d for d in deltas)


@pytest.fixture(scope="module")
def partial_ids(tok) -> list[int]:
    """Ids (among the first few thousand) that are not a whole character on their own."""
    return [t for t in range(4000) if REPLACEMENT in tok.decode([t])]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids(tok, partial_ids, seed, skip):
    # Arbitrary ids may form invalid UTF-8; the stream must still add up to the full decode.
    rng = random.Random(seed)
    pool = partial_ids + list(range(64))  # lone bytes, specials (0..16) and ASCII
    ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(tok.vocab_size) for _ in range(120)]
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas, tail, detok = _stream(tok, tok.encode("Prompt text"), ids, skip=skip)
    assert "".join(deltas) + tail == full
    assert detok.text == full


class _WindowRecorder:
    """A decoder that records the longest window it was asked to decode, around a real tokenizer."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_window_stays_bounded_on_tokens_that_decode_to_nothing(tok):
    """10,000 skipped special tokens (each decodes to "") neither grow the window nor lose the text after."""
    recorder = _WindowRecorder(tok)
    detok = IncrementalDetokenizer(recorder, tok.encode("Say:"))
    assert all(detok.add(IM_END) == "" for _ in range(10_000))
    assert recorder.longest <= 40  # the window, not the 10,000 tokens
    tail = tok.encode("Hello world, déjà vu 🙂")
    out = "".join(detok.add(t) for t in tail) + detok.flush()
    assert out == tok.decode(tail) and REPLACEMENT not in out
