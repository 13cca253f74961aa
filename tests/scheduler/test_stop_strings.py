"""scheduler.output.stop_strings.StopStringMatcher: stop strings matched across feeds, possible starts held back."""
from __future__ import annotations

import random

import pytest

from scheduler.output.stop_strings import StopMatch, StopStringMatcher


def _run(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, StopMatch | None, int]:
    """Feeds chunks until a match; returns (emitted text, match, chunks fed)."""
    emitted = ""
    for n, chunk in enumerate(chunks, 1):
        out, match = matcher.feed(chunk)
        emitted += out
        if match is not None:
            return emitted, match, n
    return emitted + matcher.flush(), None, len(chunks)


def test_stop_split_across_two_feeds():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello ", None)
    out, match = m.feed("OP and more")
    assert out == ""
    assert match == StopMatch("STOP", "")  # "hello " was already emitted; nothing of "STOP" was


def test_stop_split_across_three_feeds_emits_nothing_of_it():
    m = StopStringMatcher(["<end>"])
    assert m.feed("abc<") == ("abc", None)
    assert m.feed("en") == ("", None)
    out, match = m.feed("d>tail")
    assert out == ""
    assert match is not None and match.stop == "<end>" and match.text == ""


def test_partly_diverged_hold_is_released_in_part():
    m = StopStringMatcher(["###"])
    assert m.feed("a#") == ("a", None)
    assert m.feed("b##") == ("#b", None)  # "#" diverged; the new "##" is held
    assert m.feed("#x") == ("", StopMatch("###", ""))


def test_match_text_carries_held_text_that_diverged():
    m = StopStringMatcher(["abc"])
    assert m.feed("xab") == ("x", None)
    # "ab" held, then "ab" + "abc": the first "ab" was not the stop but is only released with the match
    assert m.feed("abc") == ("", StopMatch("abc", "ab"))


def test_text_held_then_released_when_it_diverges():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("O") == ("", None)
    assert m.feed("RM") == ("STORM", None)
    assert m.flush() == ""


def test_divergence_keeps_holding_a_new_possible_start():
    m = StopStringMatcher(["abc"])
    assert m.feed("ab") == ("", None)
    assert m.feed("ab") == ("ab", None)  # "abab": first "ab" can no longer start "abc", second can
    assert m.feed("c") == ("", StopMatch("abc", ""))


def test_flush_returns_held_text():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("42 </ans") == ("42 ", None)
    assert m.flush() == "</ans"
    assert m.flush() == ""


@pytest.mark.parametrize("include, text", [(False, ""), (True, "END")])
def test_include_stop(include, text):
    m = StopStringMatcher(["END"], include_stop=include)
    assert m.feed("value: E") == ("value: ", None)
    assert m.feed("ND!") == ("", StopMatch("END", text))


def test_include_stop_with_held_prefix_in_match_text():
    m = StopStringMatcher(["\n\n"], include_stop=True)
    assert m.feed("para\n") == ("para", None)
    assert m.feed("\nnext") == ("", StopMatch("\n\n", "\n\n"))


def test_match_within_one_feed_cuts_the_text():
    m = StopStringMatcher(["STOP"])
    assert m.feed("one two STOP three") == ("", StopMatch("STOP", "one two "))
    m = StopStringMatcher(["STOP"], include_stop=True)
    assert m.feed("one two STOP three") == ("", StopMatch("STOP", "one two STOP"))


def test_earliest_match_wins():
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("hello world") == ("", StopMatch("lo", "hel"))
    m = StopStringMatcher(["zzz", "b", "a"])
    assert m.feed("xxab") == ("", StopMatch("a", "xx"))


def test_longer_stop_wins_at_the_same_position():
    m = StopStringMatcher(["ab", "abc"])
    assert m.feed("xabcd") == ("", StopMatch("abc", "x"))
    m = StopStringMatcher(["abc", "ab"], include_stop=True)
    assert m.feed("xabcd") == ("", StopMatch("abc", "xabc"))


def test_overlapping_stops():
    # "aab" and "abc" overlap in "aabc"; "aab" completes first and starts first
    m = StopStringMatcher(["abc", "aab"])
    assert m.feed("xa") == ("x", None)
    assert m.feed("a") == ("", None)  # "aa" may start "aab"
    assert m.feed("bc") == ("", StopMatch("aab", ""))
    # one stop's start is another's end
    m = StopStringMatcher(["ba", "ab"])
    assert m.feed("cb") == ("c", None)
    assert m.feed("ab") == ("", StopMatch("ba", ""))


def test_stop_that_contains_another_is_matched_when_the_inner_one_completes():
    # Streaming semantics: after each feed, the first occurrence completed so far ends the sequence.
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("a") == ("", None)
    assert m.feed("bc") == ("", StopMatch("bc", "a"))


def test_stop_at_the_very_start():
    m = StopStringMatcher(["Human:"])
    assert m.feed("Human: hi") == ("", StopMatch("Human:", ""))
    m = StopStringMatcher(["Human:"])
    assert m.feed("Hu") == ("", None)
    assert m.feed("man:") == ("", StopMatch("Human:", ""))


def test_empty_stops_pass_everything_through():
    for stops in ([], [""], ("",)):
        m = StopStringMatcher(stops)
        for chunk in ["a", "STOP", "", "\n\n", "🙂"]:
            assert m.feed(chunk) == (chunk, None)
        assert m.flush() == ""


def test_empty_feed_is_harmless():
    m = StopStringMatcher(["xy"])
    assert m.feed("") == ("", None)
    assert m.feed("ax") == ("a", None)
    assert m.feed("") == ("", None)
    assert m.feed("y") == ("", StopMatch("xy", ""))


def test_single_character_stop_holds_nothing():
    m = StopStringMatcher(["."])
    assert m.feed("abc") == ("abc", None)
    assert m.feed("d.e") == ("", StopMatch(".", "d"))


def test_unicode_stops():
    m = StopStringMatcher(["🙂🚀", "。"])
    assert m.feed("日本🙂") == ("日本", None)
    assert m.feed("🚀x") == ("", StopMatch("🙂🚀", ""))


# ------------------------------------------------------------------ property test against str.find


def _reference(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """(text emitted before finishing, stop matched) for stops none of which contains another: the stop
    occurring first in full (the longest at equal positions) ends the text."""
    best = None
    for s in stops:
        at = full.find(s)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(s) > len(best[1]))):
            best = (at, s)
    if best is None:
        return full, None
    at, s = best
    return full[:at + len(s)] if include else full[:at], s


def _reference_per_char(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Fed one character at a time with any stops: the occurrence that ends first wins (the longest of those
    ending at the same place)."""
    for end in range(1, len(full) + 1):
        ending = [s for s in stops if full[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return (full[:end] if include else full[:end - len(s)]), s
    return full, None


def _random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 6))))
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]  # may include empty pieces


def _random_stops(rng: random.Random, alphabet: str, substring_free: bool) -> list[str]:
    stops: list[str] = []
    for _ in range(rng.randint(1, 4)):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        if substring_free and any(s in t or t in s for t in stops):
            continue
        stops.append(s)
    return stops


@pytest.mark.parametrize("seed", range(20))
def test_property_random_splits_match_reference(seed):
    rng = random.Random(seed)
    for _ in range(200):
        alphabet = rng.choice(["ab", "abc", "abcd", "aé🙂\n"])
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = _random_stops(rng, alphabet, substring_free=True)
        include = rng.random() < 0.5
        expected_text, expected_stop = _reference(full, stops, include)
        emitted, match, _ = _run(StopStringMatcher(stops, include), _random_split(rng, full))
        got_text = emitted + (match.text if match else "")
        assert (got_text, match.stop if match else None) == (expected_text, expected_stop), (full, stops)
        if match is not None:
            # nothing of the stop string was streamed before the match
            assert len(emitted) <= full.find(match.stop)


@pytest.mark.parametrize("seed", range(10))
def test_property_char_by_char_any_stops(seed):
    rng = random.Random(1000 + seed)
    for _ in range(200):
        alphabet = rng.choice(["ab", "abc", "xyz🙂"])
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stops = _random_stops(rng, alphabet, substring_free=False)
        include = rng.random() < 0.5
        expected_text, expected_stop = _reference_per_char(full, stops, include)
        emitted, match, _ = _run(StopStringMatcher(stops, include), list(full))
        got_text = emitted + (match.text if match else "")
        assert (got_text, match.stop if match else None) == (expected_text, expected_stop), (full, stops)
