"""What a request's stream reports as it goes (queue time, tokens, its end): the hooks the metrics implement
(scheduler/metrics.py). A protocol here, at the bottom, so that the streams and the engines report without
importing the metrics."""
from __future__ import annotations

from typing import Protocol

from scheduler.output.step_outcome import Verified
from scheduler.request import FinishReason


class RequestEvents(Protocol):
    def admitted(self, queued_s: float) -> None:
        """First admitted into a batch after queued_s seconds in the queue."""

    def first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None: ...

    def next_token(self, itl_s: float) -> None: ...

    def finished(self, reason: FinishReason, e2e_s: float, prompt_tokens: int, generated_tokens: int) -> None: ...

    def failed(self, code: str) -> None:
        """Ended with an error: code is the gRPC status name (CANCELLED: the client went away)."""

    def speculated(self, verified: list[Verified], seconds: float) -> None:
        """A step of `seconds` verified these drafts (one entry per sequence, or per burst)."""

    def refused(self, reason: str) -> None:
        """A request was refused for overload before any of it ran (tandem.errors.Overloaded's reason)."""

    def stalled(self) -> None:
        """A request was stopped because its client left its stream unread (--stream-stall-timeout-s)."""

    def recomputed(self, tokens: int) -> None:
        """A request re-admitted after its cache was lost (preemption, executor lost, transfer failed) computes
        these tokens again (those the prefix cache gave back are not counted)."""

    def kv_transferred(self, num_bytes: int, seconds: float) -> None:
        """A request's KV moved to another executor (ImportKv): its bytes and the call's time."""

    def kv_transfer_failed(self) -> None:
        """Moving a request's KV failed: it is recomputed where it went."""

    def migrated(self) -> None:
        """A request continues on another executor with its KV (drain, or prefill -> decode)."""
