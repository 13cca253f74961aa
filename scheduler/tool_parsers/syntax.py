"""What every family's tool-call syntax shares: the pieces a scan cuts a model's text into (text the user reads,
calls), the base class of a syntax, and the reading of a call written as a JSON object {"name": ..., "arguments":
{...}} (Hermes/Qwen/SmolLM3 in tags, Llama 3's bare JSON, Mistral's array).

A scan reads the text seen so far and returns the pieces it has decided, in order; what it cannot decide yet (the
start of a marker, a call whose name has not come) is left out until more text decides it. `final` says that no
text follows. A call whose name and the start of its arguments came is a call from then on: if its text breaks
later (its arguments stop being JSON, or the output ends first), the Call says so (`broken`) and the reader
decides what the client sees.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from scheduler.tool_parsers.json_prefix import Memo, Reach, skip_ws, string_end, value_end


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it: so far, or all of it when done
    done: bool = False  # the call and its closing syntax are complete, its arguments a JSON object
    broken: str | None = None  # the call's whole text, when it stopped parsing after it showed
    tail: str = ""  # (broken) what follows the valid part of its arguments, to the end of the call's text


Piece = Text | Call


class Syntax:
    """One family's tool-call syntax. name: as vLLM's --tool-call-parser names it. markers: the strings the syntax
    needs to see in the text (the scheduler keeps the special tokens among them when it detokenizes)."""

    name = ""
    markers: tuple[str, ...] = ()

    def scan(self, text: str, final: bool, tools: frozenset[str], memo: Memo | None = None) -> list[Piece]:
        """The pieces of text decided so far. memo: the reader's, for JSON values read again as the text grows."""
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of text that is the start of a marker (and so may become one)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


@dataclass(frozen=True)
class CallObject:
    """How far a call written as a JSON object has come. state: "undecided" (more text may make it a call; nothing
    shown yet), "text" (not a call), "call" (a call in progress: name known, arguments so far), "done", "broken"
    (a call that stopped parsing after it showed). end: done: just past the object; broken: where it broke.
    args_end: just past the (valid part of the) arguments in the text."""
    state: str
    name: str | None = None
    arguments: str = ""
    end: int = 0
    args_end: int = 0


class _Reading:
    """The object read so far: its name and arguments, where the arguments sit."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: str | None = None
        self.args_end = 0

    # A call shows once its name and the start of its arguments came: until then it may still turn out not to be one.
    def progress(self) -> CallObject:
        if self.name is None or self.arguments is None:
            return CallObject("undecided")
        return CallObject("call", self.name, self.arguments, args_end=self.args_end)

    def refused(self, at: int) -> CallObject:
        if self.name is None or self.arguments is None:
            return CallObject("text")
        return CallObject("broken", self.name, self.arguments, at, self.args_end)

    def args(self, text: str, start: int, end: int) -> None:
        self.arguments, self.args_end = text[start:end], end


def read_call_object(text: str, i: int, tools: frozenset[str], final: bool, memo: Memo | None = None,
                     args_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallObject:
    """Reads {"name": <a tool's name>, "arguments": {...}} starting at text[i] (after whitespace); "type": "function"
    may be there too (Llama 3.2 writes it). Keys in any order; the name must be one of the tools. Once final, an
    object still open is not a call (no name yet) or broken."""
    out = _read(text, i, tools, args_keys, memo)
    if final and out.state == "undecided":
        return CallObject("text")
    if final and out.state == "call":
        return CallObject("broken", out.name, out.arguments, len(text), out.args_end)
    return out


def _string(text: str, i: int, r: _Reading) -> tuple[str, int, CallObject | None]:
    """The JSON string starting at text[i], and the index after it; or the CallObject to answer with when the
    string is cut short (progress) or broken (refused)."""
    e = string_end(text, i)
    if e.reach is Reach.PARTIAL:
        return "", e.end, r.progress()
    if e.reach is Reach.BROKEN:
        return "", e.end, r.refused(e.end)
    return json.loads(text[i:e.end]), e.end, None


def _read(text: str, i: int, tools: frozenset[str], args_keys: tuple[str, ...], memo: Memo | None) -> CallObject:
    i = skip_ws(text, i)
    if i >= len(text):
        return CallObject("undecided")
    if text[i] != "{":
        return CallObject("text")
    i += 1
    r = _Reading()
    seen: set[str] = set()
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return r.progress()
        if text[i] == "}":
            if r.name is None:
                return CallObject("text")
            if r.arguments is None:
                return CallObject("done", r.name, "{}", i + 1, i)
            return CallObject("done", r.name, r.arguments, i + 1, r.args_end)
        if seen:
            if text[i] != ",":
                return r.refused(i)
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return r.progress()
        if text[i] != '"':
            return r.refused(i)
        key, end, stop = _string(text, i, r)
        if stop is not None:
            return stop
        if key in seen or key not in ("name", "type", *args_keys):
            return r.refused(i)
        seen.add(key)
        i = skip_ws(text, end)
        if i >= len(text):
            return r.progress()
        if text[i] != ":":
            return r.refused(i)
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return r.progress()
        if key in ("name", "type"):
            if text[i] != '"':
                return r.refused(i)
            value, end, stop = _string(text, i, r)
            if stop is not None:
                return stop
            if key == "name":
                if value not in tools:
                    return CallObject("text")  # (no name came before it: nothing was shown as a call)
                r.name = value
            elif value != "function":
                return r.refused(i)
            i = end
            continue
        if text[i] != "{":
            return r.refused(i)
        e = value_end(text, i, memo)
        r.args(text, i, e.end)
        if e.reach is Reach.PARTIAL:
            return r.progress()
        if e.reach is Reach.BROKEN:
            return r.refused(e.end)
        i = e.end
