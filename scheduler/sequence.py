"""One request's life inside the scheduler: its tokens, where its KV cache stands, its stop conditions and
the stream of deltas back to the client."""
from __future__ import annotations

import asyncio
import enum
from typing import Sequence as Seq

from tandem.errors import TandemError
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.request import Delta, FinishReason, GenerateRequest, TokenLogprob, Usage
from scheduler.stop_strings import StopStringMatcher


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its cache was released and it will be recomputed)
    RUNNING = "running"  # admitted: it holds (or is about to get) a cache and takes part in steps
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerateRequest, arrival: int, tokenizer, eos_token_ids: Seq[int],
                 max_seq_len: int) -> None:
        self.request = request
        self.arrival = arrival  # order of submission: smaller = older
        self.status = Status.WAITING
        self.output_ids: list[int] = []
        self.cache_id = ""  # "" until the executor created one
        self.num_cached = 0  # tokens of all_ids written into the cache
        self.preemptions = 0
        # The executor's SamplingParams messages, built once by the engine: (normal, before min_new_tokens).
        self.executor_sampling: tuple = (None, None)
        self.events: asyncio.Queue[Delta | TandemError] = asyncio.Queue()
        stop = request.stopping
        self.eos_token_ids = frozenset(() if stop.ignore_eos else eos_token_ids)  # the EOS ids that stop it
        self._max_len = min(len(request.prompt_ids) + stop.max_new_tokens, max_seq_len)
        self._detok = IncrementalDetokenizer(tokenizer, request.prompt_ids, not request.keep_special_tokens)
        self._stops = StopStringMatcher(stop.stop, stop.include_stop_str_in_output)
        self._delta = Delta()

    # ----------------------------------------------------------------- token accounting
    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (prompt, then output)."""
        prompt = self.request.prompt_ids
        n = len(prompt)
        if stop <= n:
            return list(prompt[start:stop])
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return list(prompt[start:]) + self.output_ids[:stop - n]

    @property
    def remaining(self) -> int:
        """Tokens still to write before the next token can be sampled (1 for a decoding sequence)."""
        return self.num_tokens - self.num_cached

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and bool(self.output_ids)

    def reset_cache(self) -> None:
        """After preemption: the cache is gone; everything will be recomputed (outputs stay: they were sent)."""
        self.cache_id = ""
        self.num_cached = 0
        self.status = Status.WAITING
        self.preemptions += 1

    def sampling_for_next_token(self):
        """The sampling message for the token sampled after this step: EOS and stop tokens are banned
        while fewer than min_new_tokens exist."""
        normal, early = self.executor_sampling
        return early if len(self.output_ids) < self.request.stopping.min_new_tokens else normal

    # ----------------------------------------------------------------- outputs
    def append(self, token: TokenLogprob) -> None:
        """Adds a sampled token and applies the stop conditions; the result collects in the pending delta."""
        tid = token.token_id
        self.output_ids.append(tid)
        self._delta.tokens.append(token)
        n_out = len(self.output_ids)
        may_stop = n_out >= self.request.stopping.min_new_tokens
        if may_stop and (tid in self.eos_token_ids or tid in self.request.stopping.stop_token_ids):
            self._emit(self._detok.add(tid))  # its text is empty unless special tokens are kept
            self._emit_final(self._detok.flush())
            return self._finish(FinishReason.STOP, str(tid))
        text = self._detok.add(tid)
        if may_stop:
            out, match = self._stops.feed(text)
            self._delta.text += out
            if match is not None:
                self._delta.text += match.text
                return self._finish(FinishReason.STOP_SEQUENCE, match.stop)
        else:
            self._delta.text += text  # before min_new_tokens no stop string counts; nothing to hold back
        if self.num_tokens >= self._max_len:
            self._emit_final(self._detok.flush())
            self._finish(FinishReason.LENGTH, "")

    def abort(self) -> None:
        """Ends the stream as ABORTED (server shutdown), with the text held back so far."""
        if self.status is not Status.FINISHED:
            self._emit_final(self._detok.flush())
            self._finish(FinishReason.ABORTED, "")

    def fail(self, error: TandemError) -> None:
        """Ends the stream with an error status."""
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.events.put_nowait(error)

    def publish(self) -> None:
        """Sends the pending delta to the client's stream (if it carries anything)."""
        if self._delta:
            self.events.put_nowait(self._delta)
            self._delta = Delta()

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def _emit(self, text: str) -> None:
        # The sequence ends anyway (EOS, stop token, length): a stop string this text completes only
        # decides where the text is cut.
        if text:
            out, match = self._stops.feed(text)
            self._delta.text += match.text if match is not None else out

    def _emit_final(self, text: str) -> None:
        # No stop string can complete any more: release what was held back.
        self._emit(text)
        self._delta.text += self._stops.flush()

    def _finish(self, reason: FinishReason, stop_reason: str) -> None:
        self.status = Status.FINISHED
        self._delta.finish_reason = reason
        self._delta.stop_reason = stop_reason
        self._delta.usage = Usage(len(self.request.prompt_ids), len(self.output_ids), 0, self.preemptions)
        self.publish()
