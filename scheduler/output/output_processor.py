"""The client streams of one engine (vLLM's OutputProcessor): a RequestStream per live sequence, fed with what
each step produced. It decides the stops only text shows (stop strings) and hands those sequences back for
the policy to finish; it ends streams with their errors, as aborted at shutdown, or as cancelled."""
from __future__ import annotations

import logging
from typing import Iterable

from scheduler.request import GenerateRequest
from scheduler.output.request_events import RequestEvents
from scheduler.output.request_stream import RequestStream
from scheduler.sequence import Sequence
from scheduler.output.step_outcome import Failure, StepOutcome
from tandem.errors import Overloaded, StreamStalled

log = logging.getLogger("tandem.scheduler")


class OutputProcessor:
    def __init__(self, tokenizer, events: RequestEvents | None = None) -> None:
        self.tokenizer = tokenizer
        self.events = events  # where streams report latencies and endings (the metrics); None = nowhere
        self.streams: dict[Sequence, RequestStream] = {}

    def open(self, seq: Sequence, request: GenerateRequest) -> RequestStream:
        stream = self.streams[seq] = RequestStream(request, self.tokenizer, self.events)
        return stream

    def adopt(self, seq: Sequence, stream: RequestStream) -> None:
        """A stream another engine gave up (its executor was lost) continues here."""
        self.streams[seq] = stream

    def take(self, seqs: Iterable[Sequence]) -> list[tuple[Sequence, RequestStream]]:
        """Removes these sequences' streams (for another engine to adopt)."""
        return [(seq, self.streams.pop(seq)) for seq in seqs if seq in self.streams]

    def admitted(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            if seq.lost_tokens:  # computed before, lost, and computed again now (less what was reused)
                if self.events is not None:
                    self.events.recomputed(max(0, seq.lost_tokens - seq.num_cached))
                seq.lost_tokens = 0
            stream = self.streams.get(seq)
            if stream is not None:
                stream.admitted()

    def prefixes_found(self, seqs: Iterable[Sequence]) -> None:
        """These sequences got caches reusing cached prompt tokens (usage.cached_tokens)."""
        for seq in seqs:
            stream = self.streams.get(seq)
            if stream is not None and seq.prefix_hit:
                stream.cached_tokens = seq.prefix_hit

    def process(self, outcome: StepOutcome) -> list[Sequence]:
        """Streams a step's tokens (one message per stream that got any) and ends the failed requests.
        Returns the sequences a stop string ended (the policy must finish them)."""
        self.fail(outcome.failed)
        stopped = []
        touched: dict[RequestStream, None] = {}  # (ordered) streams with new tokens
        for e in outcome.emitted:
            stream = self.streams.get(e.seq)
            if stream is None or stream.finished:  # (a stop string ended it earlier in this step's run)
                continue
            stream.drafted_tokens, stream.accepted_tokens = e.seq.drafted_tokens, e.seq.accepted_tokens
            stream.prompt_logprobs(e.seq.take_prompt_logprobs())  # (with the first token only)
            ended = stream.add(e.token, e.finish, e.seq.preemptions)
            if ended is not None and e.finish is None:  # a stop string: only the text showed it
                stopped.append(e.seq)
            touched[stream] = None
        for stream in touched:
            stream.publish()
        for p in outcome.pooled:
            stream = self.streams.get(p.seq)
            if stream is not None and not stream.finished:
                stream.pooled(p.values, p.seq.preemptions)
        if outcome.verified and self.events is not None:
            self.events.speculated(outcome.verified, outcome.seconds)
        return stopped

    def fail(self, failures: Iterable[Failure]) -> None:
        """Ends these requests' streams with their errors."""
        for f in failures:
            stream = self.streams.get(f.seq)
            if stream is not None:
                if isinstance(f.error, Overloaded) and self.events is not None:  # (the queue-time bound)
                    self.events.refused(f.error.reason)
                stream.fail(f.error)

    def stalled(self, timeout_s: float, max_buffered: int) -> list[Sequence]:
        """Ends the streams whose clients stopped reading (RequestStream.stalled) with StreamStalled, and returns
        their sequences (the engine stops them and frees their KV)."""
        ended = []
        for seq, stream in self.streams.items():
            if stream.stalled(timeout_s, max_buffered):
                log.warning("a client left its stream unread (%d messages waiting): its request was stopped after "
                            "%d tokens and its KV freed", stream.events.qsize(), len(seq.output_ids))
                stream.fail(StreamStalled(
                    f"the stream was not read for {timeout_s:g} s or fell more than {max_buffered} messages behind "
                    "(--stream-stall-timeout-s, --stream-max-buffered): the request was stopped and its KV freed"))
                if self.events is not None:
                    self.events.stalled()
                ended.append(seq)
        for seq in ended:
            del self.streams[seq]
        return ended

    def cancel(self, seq: Sequence) -> None:
        """The client went away (cancel, deadline) or its stream ended: nothing more is sent."""
        stream = self.streams.pop(seq, None)
        if stream is not None and not stream.finished:
            log.info("a request was cancelled by the client after %d tokens", len(seq.output_ids))
            stream.cancelled()

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Shutdown: these streams end as ABORTED with what they hold."""
        for seq in seqs:
            stream = self.streams.get(seq)
            if stream is not None:
                stream.abort(seq.preemptions)
