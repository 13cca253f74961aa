"""RequestStream: one request's stream back to its client: incremental detokenization, stop strings, logprobs and the pending
delta, and the queue the servicer reads. Owned by the request side; the scheduling policy never sees it.

The Sequence (scheduler/sequence.py) decides the stops it can see in token ids (EOS, stop token ids, length);
this object decides the one only text shows (a stop string) and tells the engine, which then finishes the
sequence in the policy.

It also keeps the request's timeline (queued, admitted, each token, end) and reports it to the request events
(scheduler/output/request_events.py: the metrics implement them), when it was given some.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from scheduler.output.detokenizer import IncrementalDetokenizer
from scheduler.output.event_queue import EventQueue
from scheduler.request import Delta, Finish, FinishReason, GenerateRequest, TokenLogprob, Usage
from scheduler.output.request_events import RequestEvents
from scheduler.output.stop_strings import StopStringMatcher
from tandem.errors import TandemError
from tandem.status_map import status_for


class RequestStream:
    def __init__(self, request: GenerateRequest, tokenizer, metrics: RequestEvents | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Created when the request is queued: its latencies count from here."""
        self.request = request
        self.events: EventQueue = EventQueue(clock)  # Delta | TandemError, in order
        self.finished = False
        self._completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the executor's prefix cache served (usage.cached_tokens)
        self.drafted_tokens = 0  # speculative decoding: draft tokens verified for it (usage) ...
        self.accepted_tokens = 0  # ... and accepted
        self._detok = IncrementalDetokenizer(tokenizer, request.prompt_ids, not request.keep_special_tokens)
        self._stops = StopStringMatcher(request.stopping.stop, request.stopping.include_stop_str_in_output)
        self._delta = Delta()
        self._metrics = metrics
        self._clock = clock
        self._queued_at = clock()
        self._last_token_at: float | None = None
        self._admitted = False
        # Set once the request was admitted or ended (refused, cancelled): the HTTP front sends a stream's status
        # line after it, so that a refusal in the queue is a 429, not an error event after a 200.
        self.started = asyncio.Event()
        self.refusal: TandemError | None = None  # the error that ended it before its first admission

    def admitted(self) -> None:
        """The engine admitted the request into its batch; the first time ends its queue time (a preempted or
        moved request is admitted again later: that counts once)."""
        if not self._admitted:
            self._admitted = True
            self.started.set()
            if self._metrics is not None:
                self._metrics.admitted(self._clock() - self._queued_at)

    def add(self, token: TokenLogprob, finish: Finish | None, preemptions: int = 0) -> Finish | None:
        """Adds one sampled token to the pending delta. finish: what the sequence decided from the token id
        (EOS / stop token, or length). Returns how the request ended (a stop string found in the text takes
        precedence over length), or None while it goes on."""
        self._delta.tokens.append(token)
        self._completion_tokens += 1
        self._timed_token()
        if finish is not None and finish.reason is FinishReason.STOP:
            self._emit(self._detok.add(token.token_id))  # its text is empty unless special tokens are kept
            self._emit_final(self._detok.flush())
            return self._finish(finish, preemptions)
        text = self._detok.add(token.token_id)
        if self._completion_tokens >= self.request.stopping.min_new_tokens:
            out, match = self._stops.feed(text)
            self._delta.text += out
            if match is not None:
                self._delta.text += match.text
                return self._finish(Finish(FinishReason.STOP_SEQUENCE, match.stop), preemptions)
        else:
            self._delta.text += text  # before min_new_tokens no stop string counts; nothing to hold back
        if finish is not None:  # length
            self._emit_final(self._detok.flush())
            return self._finish(finish, preemptions)
        return None

    def pooled(self, values: tuple[float, ...], preemptions: int = 0) -> None:
        """A pooled request's values: its one message, which ends it (no token, no text)."""
        self._timed_token()
        self._delta.pooled = values
        self._finish(Finish(FinishReason.STOP), preemptions)

    def prompt_logprobs(self, entries: tuple[TokenLogprob, ...] | None) -> None:
        """The request's prompt logprobs, for the pending delta (None: nothing to add)."""
        if entries is not None:
            self._delta.prompt_logprobs = entries

    def abort(self, preemptions: int = 0) -> None:
        """Ends the stream as ABORTED (server shutdown), with the text held back so far."""
        if not self.finished:
            self._emit_final(self._detok.flush())
            self._finish(Finish(FinishReason.ABORTED), preemptions)

    def fail(self, error: TandemError) -> None:
        """Ends the stream with an error status."""
        if not self.finished:
            self.finished = True
            if not self._admitted:
                self.refusal = error
            self.started.set()
            self.events.put_nowait(error)
            if self._metrics is not None:
                self._metrics.failed(status_for(error).name)

    def cancelled(self) -> None:
        """The client went away before the end (cancel, deadline): counted, nothing more is sent."""
        if not self.finished:
            self.finished = True
            self.started.set()
            if self._metrics is not None:
                self._metrics.failed("CANCELLED")

    def stalled(self, timeout_s: float, max_buffered: int) -> bool:
        """Whether the client has left a message unread for more than timeout_s, or more than max_buffered
        messages (a reader that stopped, or one slower than the generation)."""
        return not self.finished and (self.events.oldest_wait(self._clock()) > timeout_s
                                      or self.events.qsize() > max_buffered)

    def publish(self) -> None:
        """Sends the pending delta to the client's stream (if it carries anything)."""
        if self._delta:
            self.events.put_nowait(self._delta)
            self._delta = Delta()

    def _emit(self, text: str) -> None:
        # The request ends anyway (EOS, stop token, length): a stop string this text completes only decides
        # where the text is cut.
        if text:
            out, match = self._stops.feed(text)
            self._delta.text += match.text if match is not None else out

    def _emit_final(self, text: str) -> None:
        # No stop string can complete any more: release what was held back.
        self._emit(text)
        self._delta.text += self._stops.flush()

    def _timed_token(self) -> None:
        now = self._clock()
        if self._metrics is not None:
            if self._last_token_at is None:
                self._metrics.first_token(now - self._queued_at, len(self.request.prompt_ids), self.cached_tokens)
            else:
                self._metrics.next_token(now - self._last_token_at)
        self._last_token_at = now

    def _finish(self, finish: Finish, preemptions: int) -> Finish:
        self.finished = True
        self.started.set()
        if self._metrics is not None:
            self._metrics.finished(finish.reason, self._clock() - self._queued_at, len(self.request.prompt_ids),
                                   self._completion_tokens)
        self._delta.finish_reason = finish.reason
        self._delta.stop_reason = finish.stop_reason
        self._delta.usage = Usage(len(self.request.prompt_ids), self._completion_tokens, self.cached_tokens,
                                  preemptions, self.drafted_tokens, self.accepted_tokens)
        self.publish()
        return finish
