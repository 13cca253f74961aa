"""scheduler.sequence.Sequence (token state, token-id stops) and scheduler.output.request_stream.RequestStream (text,
stop strings, deltas) with SmolLM2's tokenizer, glued as the engine glues them."""
from __future__ import annotations

import asyncio

import pytest

from tandem.errors import Unavailable
from scheduler.request import Delta, FinishReason, GenerateRequest, StoppingCriteria, TokenLogprob, Usage
from scheduler.output.request_stream import RequestStream
from scheduler.sequence import Sequence, Status

EOS = 2  # <|im_end|>
ENDOFTEXT = 0  # <|endoftext|>, another special token
MAX_SEQ_LEN = 8192


class Tracked:
    """A Sequence and its RequestStream, fed as scheduler/engine/engine.py feeds them; other attributes are the
    sequence's."""

    def __init__(self, seq: Sequence, out: RequestStream) -> None:
        self.seq, self.out, self.events = seq, out, out.events

    def append(self, token: TokenLogprob) -> None:
        finish = self.seq.append(token.token_id)
        if self.out.add(token, finish, self.seq.preemptions) is not None and finish is None:
            self.seq.status = Status.FINISHED  # a stop string (the engine: policy.abort)

    def publish(self) -> None:
        self.out.publish()

    def abort(self) -> None:
        self.seq.status = Status.FINISHED
        self.out.abort(self.seq.preemptions)

    def fail(self, error) -> None:
        self.seq.status = Status.FINISHED
        self.out.fail(error)

    def __getattr__(self, name: str):
        return getattr(self.seq, name)

    def __setattr__(self, name: str, value) -> None:
        if name in ("seq", "out", "events"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.seq, name, value)


def make(tok, prompt: str = "Hello", max_new: int = 50, eos=(EOS,), max_seq_len: int = MAX_SEQ_LEN,
         keep_special: bool = False, arrival: int = 0, **stopping) -> Tracked:
    request = GenerateRequest("req-1", tuple(tok.encode(prompt)), StoppingCriteria(max_new, **stopping),
                              keep_special_tokens=keep_special)
    return Tracked(Sequence(request, arrival, eos, max_seq_len), RequestStream(request, tok))


def lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5 - token_id / 1e5, ((token_id, -0.5), (token_id + 1, -1.5)))


def drain(seq: Sequence) -> list:
    out = []
    while True:
        try:
            out.append(seq.events.get_nowait())
        except asyncio.QueueEmpty:
            return out


def run(seq: Sequence, ids: list[int]) -> list[Delta]:
    """Appends ids one by one (stopping when the sequence finishes), publishing after each as the engine does;
    returns the deltas that came out."""
    for t in ids:
        seq.append(lp(t))
        seq.publish()
        if seq.finished:
            break
    return drain(seq)


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t.token_id for d in deltas for t in d.tokens]


def check_final(deltas: list[Delta], reason: FinishReason, stop_reason: str) -> Delta:
    last = deltas[-1]
    assert last.finish_reason is reason
    assert last.stop_reason == stop_reason
    assert last.usage is not None
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    return last


# ------------------------------------------------------------------ EOS and stop tokens


def test_eos_stops_and_its_text_is_left_out(tok):
    seq = make(tok)
    out = tok.encode(" world!") + [EOS]
    deltas = run(seq, out + tok.encode(" never"))
    last = check_final(deltas, FinishReason.STOP, str(EOS))
    assert seq.finished and seq.status is Status.FINISHED
    assert text_of(deltas) == " world!"
    assert "<|im_end|>" not in text_of(deltas)
    assert tokens_of(deltas) == out  # the EOS token itself is reported
    assert seq.output_ids == out
    assert last.usage == Usage(len(seq.request.prompt_ids), len(out), 0, 0)


def test_eos_text_kept_with_keep_special_tokens(tok):
    seq = make(tok, keep_special=True)
    deltas = run(seq, tok.encode(" hi") + [EOS])
    check_final(deltas, FinishReason.STOP, str(EOS))
    assert text_of(deltas) == " hi<|im_end|>"


def test_several_eos_ids(tok):
    seq = make(tok, eos=(EOS, ENDOFTEXT))
    deltas = run(seq, tok.encode(" a") + [ENDOFTEXT])
    check_final(deltas, FinishReason.STOP, str(ENDOFTEXT))
    assert text_of(deltas) == " a"


def test_ignore_eos_continues_until_length(tok):
    seq = make(tok, max_new=5, ignore_eos=True)
    out = tok.encode(" a") + [EOS] + tok.encode(" b c d e f")
    deltas = run(seq, out)
    check_final(deltas, FinishReason.LENGTH, "")
    assert seq.output_ids == out[:5]
    assert text_of(deltas) == tok.decode(out[:5])  # EOS skipped in the text like any special token


def test_non_eos_special_token_does_not_stop(tok):
    seq = make(tok, max_new=4)
    deltas = run(seq, tok.encode(" a") + [ENDOFTEXT] + tok.encode(" b c"))
    check_final(deltas, FinishReason.LENGTH, "")
    assert text_of(deltas) == " a b c"


def test_stop_token_ids(tok):
    bang = tok.encode("!")
    assert len(bang) == 1
    seq = make(tok, stop_token_ids=frozenset(bang))
    out = tok.encode(" Hi there") + bang
    deltas = run(seq, out + tok.encode(" more"))
    last = check_final(deltas, FinishReason.STOP, str(bang[0]))
    assert seq.output_ids == out
    assert text_of(deltas) == " Hi there!"  # a normal token's text is emitted
    assert last.usage.completion_tokens == len(out)


def test_special_stop_token_id_text_left_out(tok):
    seq = make(tok, eos=(), stop_token_ids=frozenset({ENDOFTEXT}))
    deltas = run(seq, tok.encode(" x") + [EOS] + tok.encode(" y") + [ENDOFTEXT])
    check_final(deltas, FinishReason.STOP, str(ENDOFTEXT))
    assert text_of(deltas) == " x y"  # EOS not in eos_token_ids here: it is an ordinary (skipped) token


@pytest.mark.parametrize("kind", ["eos", "stop_token"])
def test_min_new_tokens_suppresses_eos_and_stop_tokens(tok, kind):
    stop_id = EOS if kind == "eos" else tok.encode("!")[0]
    extra = {} if kind == "eos" else {"stop_token_ids": frozenset({stop_id})}
    seq = make(tok, min_new_tokens=3, **extra)
    deltas = run(seq, [stop_id, stop_id, stop_id, stop_id])
    check_final(deltas, FinishReason.STOP, str(stop_id))
    assert seq.output_ids == [stop_id] * 3  # the third one is the minimum: it counts


def test_min_new_tokens_suppresses_stop_strings(tok):
    seq = make(tok, min_new_tokens=3, stop=(" b",))
    out = tok.encode(" a b c b d")
    deltas = run(seq, out)
    check_final(deltas, FinishReason.STOP_SEQUENCE, " b")
    # the first " b" (token 2) is before the minimum; the second one stops
    assert text_of(deltas) == " a b c"
    assert seq.output_ids == out[:4]


# ------------------------------------------------------------------ stop strings


def test_stop_string_across_tokens(tok):
    out = tok.encode(" Hello there. END more")  # [' Hello', ' there', '.', ' END', ' more']
    seq = make(tok, prompt="Say:", stop=("lo th",))
    deltas = run(seq, out)
    check_final(deltas, FinishReason.STOP_SEQUENCE, "lo th")
    assert text_of(deltas) == " Hel"
    assert seq.output_ids == out[:2]
    # " Hel" streams at once; "lo", which may start the stop string, was never streamed
    assert [d.text for d in deltas] == [" Hel", ""]


@pytest.mark.parametrize("include, expected", [(False, " Hello there"), (True, " Hello there. END")])
def test_stop_string_include(tok, include, expected):
    seq = make(tok, stop=(". END",), include_stop_str_in_output=include)
    deltas = run(seq, tok.encode(" Hello there. END more"))
    check_final(deltas, FinishReason.STOP_SEQUENCE, ". END")
    assert text_of(deltas) == expected


def test_held_text_released_on_divergence(tok):
    seq = make(tok, stop=(" there!",))
    out = tok.encode(" Hello there. END")
    deltas = run(seq, out + [EOS])
    check_final(deltas, FinishReason.STOP, str(EOS))
    assert text_of(deltas) == " Hello there. END"
    assert [d.text for d in deltas[:3]] == [" Hello", "", " there."]


def test_kept_eos_text_finishing_a_stop_string_loses_no_text(tok):
    # BUG (scheduler/sequence.py, Sequence._emit): with keep_special_tokens the EOS token's text
    # "<|im_end|>" goes through the stop-string matcher; if it completes a stop string ("end" here, with
    # "en" held back), feed() returns ("", match) and clears its buffer, and _emit drops the match, so the
    # held "en" (and "<|im_") is never streamed. Whatever wins (EOS or the stop string), the text the
    # model produced before the match must come out.
    seq = make(tok, keep_special=True, stop=("end",))
    deltas = run(seq, tok.encode(" the en") + [EOS])  # [' the', ' en', '<|im_end|>']
    assert deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.STOP_SEQUENCE)
    assert text_of(deltas).startswith(" the en")


def test_held_text_released_at_length(tok):
    out = tok.encode(" abcxy")  # [' abc', 'xy']
    assert len(out) == 2
    seq = make(tok, max_new=2, stop=("xyz",))
    deltas = run(seq, out)
    check_final(deltas, FinishReason.LENGTH, "")
    assert text_of(deltas) == " abcxy"


def test_incomplete_character_released_at_length(tok):
    out = tok.encode("ok 🙂")
    seq = make(tok, max_new=len(out) - 1)
    deltas = run(seq, out)
    check_final(deltas, FinishReason.LENGTH, "")
    assert text_of(deltas) == tok.decode(out[:-1])  # ends in U+FFFD: what the tokens say


def test_multibyte_text_streams_without_broken_characters(tok):
    text = " 日本語 and 🙂🚀!"
    seq = make(tok)
    deltas = run(seq, tok.encode(text) + [EOS])
    assert text_of(deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)


# ------------------------------------------------------------------ length


def test_max_new_tokens_is_length(tok):
    out = tok.encode(" one two three four five six seven eight")
    seq = make(tok, max_new=3)
    deltas = run(seq, out)
    last = check_final(deltas, FinishReason.LENGTH, "")
    assert seq.output_ids == out[:3]
    assert text_of(deltas) == " one two three"
    assert last.usage == Usage(len(seq.request.prompt_ids), 3, 0, 0)


def test_model_max_length_is_length(tok):
    prompt_len = len(tok.encode("Hello there"))
    seq = make(tok, prompt="Hello there", max_new=100, max_seq_len=prompt_len + 2)
    deltas = run(seq, tok.encode(" one two three four"))
    check_final(deltas, FinishReason.LENGTH, "")
    assert len(seq.output_ids) == 2
    assert seq.num_tokens == prompt_len + 2


def test_eos_on_the_last_allowed_token_is_stop(tok):
    seq = make(tok, max_new=2)
    deltas = run(seq, tok.encode(" a") + [EOS])
    check_final(deltas, FinishReason.STOP, str(EOS))


def test_stop_string_on_the_last_allowed_token_is_stop_sequence(tok):
    seq = make(tok, max_new=2, stop=("b",))
    deltas = run(seq, tok.encode(" a b"))
    check_final(deltas, FinishReason.STOP_SEQUENCE, "b")
    assert text_of(deltas) == " a "


# ------------------------------------------------------------------ events


def test_publish_batches_tokens_into_one_delta(tok):
    seq = make(tok, max_new=10)
    seq.publish()
    assert drain(seq) == []  # nothing pending: nothing sent
    out = tok.encode(" one two three")
    for t in out:
        seq.append(lp(t))
    seq.publish()
    (delta,) = drain(seq)
    assert isinstance(delta, Delta)
    assert delta.text == " one two three"
    assert delta.tokens == [lp(t) for t in out]  # logprobs and top alternatives kept
    assert delta.finish_reason is None and delta.usage is None
    seq.publish()
    assert drain(seq) == []


def test_held_back_token_still_publishes_its_token(tok):
    seq = make(tok, stop=("xyz",))
    out = tok.encode(" abcxy")
    seq.append(lp(out[0]))
    seq.publish()
    seq.append(lp(out[1]))
    seq.publish()
    d1, d2 = drain(seq)
    assert (d1.text, tokens_of([d1])) == (" abc", [out[0]])
    assert (d2.text, tokens_of([d2])) == ("", [out[1]])  # "xy" is held: it may start "xyz"


def test_finish_publishes_by_itself(tok):
    seq = make(tok)
    seq.append(lp(tok.encode(" hi")[0]))
    seq.append(lp(EOS))  # no publish() call: finishing sends the delta
    (delta,) = drain(seq)
    assert delta.finish_reason is FinishReason.STOP
    assert delta.text == " hi"


def test_abort_releases_held_text(tok):
    seq = make(tok, stop=("xyz",))
    deltas = run(seq, tok.encode(" abcxy"))
    assert text_of(deltas) == " abc"
    seq.abort()
    (final,) = drain(seq)
    assert final.text == "xy"
    assert final.finish_reason is FinishReason.ABORTED
    assert final.usage.completion_tokens == 2
    seq.abort()  # a second abort is a no-op
    assert drain(seq) == []


def test_fail_puts_the_error(tok):
    seq = make(tok)
    err = Unavailable("executor gone")
    seq.fail(err)
    assert seq.finished
    assert drain(seq) == [err]
    seq.fail(Unavailable("again"))
    seq.abort()
    assert drain(seq) == []


# ------------------------------------------------------------------ token accounting


def test_token_slice_across_prompt_and_output(tok):
    seq = make(tok, prompt="one two three four")
    prompt = list(seq.request.prompt_ids)
    out = tok.encode(" five six seven")
    for t in out:
        seq.append(lp(t))
    all_ids = prompt + out
    n = len(all_ids)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            assert seq.token_slice(start, stop) == all_ids[start:stop], (start, stop)
    assert seq.num_tokens == n


def test_remaining_and_is_decoding(tok):
    seq = make(tok, prompt="one two three four")
    p = len(seq.request.prompt_ids)
    assert (seq.remaining, seq.is_decoding) == (p, False)
    seq.num_cached = p - 1
    assert (seq.remaining, seq.is_decoding) == (1, False)  # last prompt token: still prefill
    seq.num_cached = p
    seq.append(lp(tok.encode(" five")[0]))
    assert (seq.remaining, seq.is_decoding) == (1, True)
    seq.append(lp(tok.encode(" six")[0]))  # the executor has not written it yet
    assert (seq.remaining, seq.is_decoding) == (2, False)


def test_reset_cache_counts_preemptions_and_keeps_outputs(tok):
    seq = make(tok, max_new=4)
    p = len(seq.request.prompt_ids)
    seq.status = Status.RUNNING
    seq.cache_id = "cache-7"
    seq.num_cached = p
    out = tok.encode(" one two")
    for t in out:
        seq.append(lp(t))
    seq.num_cached = p + 1
    seq.reset_cache()
    assert (seq.cache_id, seq.num_cached, seq.status, seq.preemptions) == ("", 0, Status.WAITING, 1)
    assert seq.output_ids == out
    assert seq.remaining == p + 2 and not seq.is_decoding
    seq.reset_cache()
    assert seq.preemptions == 2
    # generation carries on after recompute; usage reports the preemptions
    deltas = run(seq, tok.encode(" three four"))
    last = check_final(deltas, FinishReason.LENGTH, "")
    assert last.usage == Usage(p, 4, 0, 2)
    assert text_of(deltas) == " one two three four"
