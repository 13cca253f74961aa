"""The scheduler's deltas (scheduler/request.py) -> OpenAI responses: a whole chat.completion /
text_completion, or the chunks of its SSE stream, with logprobs and usage as OpenAI documents them.

finish_reason: "length" (max_tokens or the model's length), "stop" (EOS, a stop token, a stop string), "abort"
(the server shut down before the end, as vLLM says), "tool_calls" (a tool choice's calls are complete);
stop_reason (vLLM's): the stop string matched, or the stop token's id. usage counts each prompt once however
many choices it has (prompt_tokens, cached_tokens) and every choice's tokens (completion_tokens). With vLLM's
stream_options.continuous_usage_stats every chunk of a choice also carries that choice's usage so far (its
prompt's tokens, its tokens generated), as vLLM 0.10.1.1 streams it.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from functools import lru_cache

from scheduler.http import response_schemas as s
from scheduler.http.prompt_echo import echo_logprobs, vllm_prompt_logprobs
from scheduler.http.reasoning_output import ChoiceReasoning
from scheduler.http.tool_calls import ToolCallStream, ToolMode, auto_delta, calls
from scheduler.request import Delta, FinishReason, TokenLogprob
from scheduler.request import Usage as DomainUsage

DONE = "data: [DONE]\n\n"
_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop",
           FinishReason.ABORTED: "abort"}


def sse(payload: s.Out | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, s.Out) else json.dumps(payload)
    return f"data: {data}\n\n"


class TokenTexts:
    """A token id's text as logprobs show it: its own piece (special tokens kept), or "token_id:<id>" with
    vLLM's return_tokens_as_token_ids. Pieces are cached: logprobs name the same tokens over and over."""

    def __init__(self, tokenizer) -> None:
        self.piece = lru_cache(maxsize=1 << 16)(lambda i: tokenizer.pieces([i])[0])

    def __call__(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.piece(token_id)


def stop_reason(d: Delta) -> int | str | None:
    if d.finish_reason is FinishReason.STOP_SEQUENCE:
        return d.stop_reason
    if d.finish_reason is FinishReason.STOP and d.stop_reason.isdigit():
        return int(d.stop_reason)
    return None


def usage(usages: list[DomainUsage | None], n: int) -> s.Usage:
    """usages: one per choice, choices of prompt p at p*n .. p*n + n - 1."""
    done = [u for u in usages if u is not None]
    firsts = [u for u in usages[::n] if u is not None]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in done)
    drafted, accepted = sum(u.drafted_tokens for u in done), sum(u.accepted_tokens for u in done)
    return s.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=s.PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in firsts)),
                   completion_tokens_details=s.CompletionTokensDetails(
                       accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted)
                   if drafted else None)


class _Renderer:
    """What both kinds share: ids, choice state (text, tokens, finish, usage), token texts."""

    prefix = ""

    def __init__(self, model: str, choices: int, n: int, texts: TokenTexts, as_ids: bool,
                 include_usage: bool, continuous_usage: list[int] | None = None, request_id: str | None = None) -> None:
        """continuous_usage: per choice its prompt's tokens, when every chunk carries the choice's usage so far.
        request_id: vLLM's, the response's id after the prefix (default: a random one)."""
        self.id = f"{self.prefix}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.texts = texts
        self.as_ids = as_ids
        self.include_usage = include_usage
        self.text = [""] * choices
        self.tokens: list[list[TokenLogprob]] = [[] for _ in range(choices)]
        self.last: list[Delta | None] = [None] * choices
        self.usages: list[DomainUsage | None] = [None] * choices
        self.prompt_entries: list[tuple[TokenLogprob, ...] | None] = [None] * choices  # (the first delta's)
        self.prompt_tokens = continuous_usage
        self.generated = [0] * choices  # tokens of each choice so far (continuous usage)

    def add(self, index: int, d: Delta) -> None:
        """Accumulates a delta (for a whole response; chunks only need note())."""
        self.text[index] += d.text
        self.tokens[index] += d.tokens
        self.note(index, d)

    def note(self, index: int, d: Delta) -> None:
        self.generated[index] += len(d.tokens)
        if d.prompt_logprobs is not None:
            self.prompt_entries[index] = d.prompt_logprobs
        if d.finish_reason is not None:
            self.last[index] = d
            self.usages[index] = d.usage

    def usage(self) -> s.Usage:
        return usage(self.usages, self.n)

    def usage_so_far(self, index: int) -> s.Usage | None:
        """Choice index's usage so far, on every chunk with continuous usage stats; None otherwise."""
        if self.prompt_tokens is None:
            return None
        prompt, done = self.prompt_tokens[index], self.generated[index]
        return s.Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def opening(self) -> list[str]:
        """Chunks sent before any delta."""
        return []

    def _text(self, token_id: int) -> str:
        return self.texts(token_id, self.as_ids)

    def _top(self, t: TokenLogprob) -> list[s.TopLogprob]:
        return [s.TopLogprob(token=(x := self._text(i)), logprob=lp, bytes=list(x.encode()))
                for i, lp in t.top]


class ChatRenderer(_Renderer):
    prefix = "chatcmpl"

    def __init__(self, *args, logprobs: bool, tool_mode: ToolMode | None = None, prompt_logprobs: bool = False,
                 reasoning: ChoiceReasoning | None = None, **kw) -> None:
        """tool_mode: the output is a tool call (scheduler/http/tool_calls.py), answered as tool_calls.
        prompt_logprobs: the whole response carries vLLM's prompt_logprobs (of its one prompt). reasoning: the
        outputs' thinking goes to reasoning_content (and vLLM's newer `reasoning`), the answer to content (and
        the tool calls)."""
        super().__init__(*args, **kw)
        self.reasoning = reasoning
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.tool_mode = tool_mode
        auto = tool_mode is not None and tool_mode.auto is not None
        self.tool_streams = [ToolCallStream(tool_mode) for _ in self.text] if tool_mode is not None and not auto \
            else []
        self.readers = [tool_mode.reader() for _ in self.text] if auto else []  # (auto: the model's own calls)

    def _logprobs(self, tokens: list[TokenLogprob]) -> s.ChatLogprobs | None:
        if not self.logprobs:
            return None
        return s.ChatLogprobs(content=[
            s.TokenLogprobOut(token=(x := self._text(t.token_id)), logprob=t.logprob, bytes=list(x.encode()),
                              top_logprobs=self._top(t)) for t in tokens])

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> str:
        if usage is None and len(choices) == 1:
            usage = self.usage_so_far(choices[0].index)  # (continuous usage stats; else null but on the last)
        return sse(s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                         usage=usage))

    def opening(self) -> list[str]:
        """The first chunk of every choice: the assistant role."""
        return [self._chunk([s.ChatChunkChoice(index=i, delta=s.ChatDelta(role="assistant", content=""),
                                               logprobs=None, finish_reason=None)])
                for i in range(len(self.text))]

    def _split(self, index: int, d: Delta) -> tuple[str, str]:
        """(answer text, reasoning text) of a delta."""
        if self.reasoning is None:
            return d.text, ""
        piece = self.reasoning.delta(index, d.text, d.finish_reason is not None)
        return piece.content, piece.reasoning

    def chunk(self, index: int, d: Delta) -> str | None:
        choice = self.chunk_choice(index, d)
        return None if choice is None else self._chunk([choice])

    def chunk_choice(self, index: int, d: Delta) -> s.ChatChunkChoice | None:
        """The stream choice this delta makes (None: nothing to say yet); /v1/responses turns it into events."""
        self.note(index, d)
        text, thought = self._split(index, d)
        if self.readers:
            return self._auto_chunk(index, d, text, thought)
        if self.tool_mode is not None:
            return self._tool_chunk(index, d, text, thought)
        if not text and not thought and d.finish_reason is None and not (self.logprobs and d.tokens):
            return None  # text held back (a possible stop string): nothing to say yet
        return s.ChatChunkChoice(index=index, delta=s.ChatDelta(content=text or None, reasoning_content=thought or None,
                                                                reasoning=thought or None),
                                 logprobs=self._logprobs(d.tokens),
                                 finish_reason=None if d.finish_reason is None else _FINISH[d.finish_reason],
                                 stop_reason=stop_reason(d))

    def _tool_chunk(self, index: int, d: Delta, text: str, thought: str) -> s.ChatChunkChoice | None:
        stream = self.tool_streams[index]
        finished = d.finish_reason is not None
        calls_delta = stream.delta(text, finished) if text or finished or stream.started else None
        content = None
        if finished and stream.mode.name is None and calls_delta is None:
            content = stream.text or None  # "required" cut before its array closed: the text as it is
        if (calls_delta is None and content is None and not thought and not finished
                and not (self.logprobs and d.tokens)):
            return None
        finish = None if not finished else self._tool_finish(d, content is None)
        choice = s.ChatChunkChoice(index=index, delta=s.ChatDelta(content=content, tool_calls=calls_delta,
                                                                  reasoning_content=thought or None,
                                                                  reasoning=thought or None),
                                   logprobs=self._logprobs(d.tokens), finish_reason=finish, stop_reason=stop_reason(d))
        return choice

    def _auto_chunk(self, index: int, d: Delta, text: str, thought: str) -> s.ChatChunkChoice | None:
        """tool_choice auto: the answer text read for calls; content and call deltas as they are decided."""
        reader = self.readers[index]
        finished = d.finish_reason is not None
        content, calls_delta = auto_delta(reader.feed(text, finished))
        if (content is None and calls_delta is None and not thought and not finished
                and not (self.logprobs and d.tokens)):
            return None
        finish = self._tool_finish(d, reader.done_calls > 0) if finished else None
        return s.ChatChunkChoice(index=index, delta=s.ChatDelta(content=content, tool_calls=calls_delta,
                                                                reasoning_content=thought or None,
                                                                reasoning=thought or None),
                                 logprobs=self._logprobs(d.tokens), finish_reason=finish, stop_reason=stop_reason(d))

    @staticmethod
    def _tool_finish(last: Delta, called: bool) -> str:
        return "tool_calls" if called and last.finish_reason is FinishReason.STOP else _FINISH[last.finish_reason]

    def closing(self) -> str:
        return self._chunk([], self.usage())

    def _message(self, i: int) -> tuple[s.ChatMessageOut, bool]:
        """Choice i's message, and whether it is tool calls."""
        content: str | None = self.text[i]
        thought = None
        if self.reasoning is not None:
            split = self.reasoning.whole(i, self.text[i])
            content, thought = split.content, split.reasoning
        if self.readers:  # tool_choice auto: the answer (after any thinking) read for the model's own calls
            read = self.readers[i].whole(content or "")
            made = [s.ToolCallOut(id=c.id, function=s.FunctionCallOut(name=c.name, arguments=c.arguments))
                    for c in read.calls]
            return s.ChatMessageOut(content=read.content, tool_calls=made or None, reasoning_content=thought,
                                    reasoning=thought), bool(made)
        if self.tool_mode is not None:
            made = calls(self.tool_mode, content or "")
            if made is not None:
                return s.ChatMessageOut(content=None, tool_calls=made, reasoning_content=thought,
                                        reasoning=thought), True
        return s.ChatMessageOut(content=content, reasoning_content=thought, reasoning=thought), False

    def whole(self) -> s.ChatCompletion:
        choices = []
        for i, last in enumerate(self.last):
            message, called = self._message(i)
            finish = self._tool_finish(last, called) if self.tool_mode is not None else _FINISH[last.finish_reason]
            choices.append(s.ChatChoice(index=i, message=message, logprobs=self._logprobs(self.tokens[i]),
                                        finish_reason=finish, stop_reason=stop_reason(last)))
        entries = self.prompt_entries[0] if self.prompt_logprobs else None
        return s.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                                usage=self.usage(), prompt_logprobs=None if entries is None
                                else vllm_prompt_logprobs(entries, self._text))


class CompletionRenderer(_Renderer):
    prefix = "cmpl"

    def __init__(self, *args, logprobs: int | None, echo: list[tuple[tuple[int, ...], str]] | None = None,
                 prompt_only: bool = False, prompt_logprobs: bool = False, **kw) -> None:
        """echo: per choice its prompt (ids, text), shown before the output; prompt_only (max_tokens 0): the
        one token generated is left out. prompt_logprobs: each choice carries vLLM's prompt_logprobs."""
        super().__init__(*args, **kw)
        self.logprobs = logprobs
        self.offsets = [0] * len(self.text)  # text_offset of each choice's next token
        self.echo = echo
        self.echoed = [False] * len(self.text)  # (streaming) the prompt went out with the choice's first chunk
        self.prompt_only = prompt_only
        self.prompt_logprobs = prompt_logprobs

    def add(self, index: int, d: Delta) -> None:
        if self.prompt_only:  # the prompt alone: the one generated token never shows
            d = Delta(finish_reason=d.finish_reason and FinishReason.LENGTH, usage=d.usage and dataclasses.replace(
                d.usage, completion_tokens=0), prompt_logprobs=d.prompt_logprobs)
        super().add(index, d)

    def _echo(self, index: int) -> tuple[str, s.CompletionLogprobs | None]:
        """The choice's prompt text, and its tokens' logprobs (with logprobs set), once per choice."""
        if self.echo is None or self.echoed[index]:
            return "", None
        self.echoed[index] = True
        ids, text = self.echo[index]
        if self.logprobs is None:
            return text, None
        out = s.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        self.offsets[index] = echo_logprobs(out, ids, self.prompt_entries[index] or (), self.logprobs, self._text,
                                            self.offsets[index])
        return text, out

    def _prompt_logprobs(self, index: int) -> s.PromptLogprobsOut | None:
        entries = self.prompt_entries[index]
        return vllm_prompt_logprobs(entries, self._text) if self.prompt_logprobs and entries is not None else None

    def _joined(self, index: int, text: str, tokens: list[TokenLogprob]) -> tuple[str, s.CompletionLogprobs | None]:
        """The choice's text and logprobs: the echoed prompt's (first time only), then the output's."""
        prompt, head = self._echo(index)  # (first: the output's text offsets follow the prompt's)
        tail = self._logprobs(index, tokens)
        if head is not None and tail is not None:
            for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                getattr(head, name).extend(getattr(tail, name))
        return prompt + text, head if head is not None else tail

    def _logprobs(self, index: int, tokens: list[TokenLogprob]) -> s.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = s.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for t in tokens:
            text = self._text(t.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(t.logprob)
            out.text_offset.append(self.offsets[index])
            self.offsets[index] += len(text)
            # OpenAI: "the logprob of the sampled token is always returned, so there may be up to logprobs+1"
            top = {self._text(i): lp for i, lp in t.top}
            top.setdefault(text, t.logprob)
            out.top_logprobs.append(top)
        return out

    def chunk(self, index: int, d: Delta) -> str | None:
        if self.prompt_only:
            d = Delta(finish_reason=d.finish_reason and FinishReason.LENGTH, prompt_logprobs=d.prompt_logprobs)
        self.note(index, d)
        first = self.echo is not None and not self.echoed[index]
        if not first and not d.text and d.finish_reason is None and not (self.logprobs is not None and d.tokens):
            return None
        text, logprobs = self._joined(index, d.text, d.tokens)
        choice = s.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                    finish_reason=None if d.finish_reason is None else _FINISH[d.finish_reason],
                                    stop_reason=stop_reason(d),
                                    prompt_logprobs=self._prompt_logprobs(index) if d.prompt_logprobs else None)
        return sse(s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                usage=self.usage_so_far(index)))

    def closing(self) -> str:
        return sse(s.Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()))

    def whole(self) -> s.Completion:
        choices = []
        for i, last in enumerate(self.last):
            text, logprobs = self._joined(i, self.text[i], self.tokens[i])
            choices.append(s.CompletionChoice(index=i, text=text, logprobs=logprobs,
                                              finish_reason=_FINISH[last.finish_reason], stop_reason=stop_reason(last),
                                              prompt_logprobs=self._prompt_logprobs(i)))
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage())
