"""What each request's attempts add up to, and whether the soak passed.

A request's outcome is its last attempt's (earlier ones ended UNAVAILABLE and were retried):
  completed          OK with exactly the clean run's answer for its key
  cancelled          the client cancelled the gRPC stream (CANCELLED is expected only then)
  disconnected       the client hung up on the HTTP request
  adapter-not-found  NOT_FOUND / 404 for a request naming an adapter (unloaded meanwhile)
  refused            RESOURCE_EXHAUSTED / 429 (a full queue, no admission in time)
  slow-stopped       a slow reader (--all) whose stream the scheduler stopped (RESOURCE_EXHAUSTED, the stall timeout)
  slow-completed     a slow reader whose whole answer fitted in the transport's buffers (OK, every token came)
A stream a shutting-down scheduler ended with finish reason abort (its --grace ran out) is re-sent like UNAVAILABLE
(SHUTDOWN_ABORT; counted in errors by status and, outside a scheduler's outage, with the unexpected UNAVAILABLEs),
and otherwise the request is LOST: a wrong answer, UNAVAILABLE still after the retry budget, or any other
status (DEADLINE_EXCEEDED is a hang; CANCELLED the client did not ask for; NOT_FOUND without an adapter).
Failures besides: any attempt answered 500 (or another 5xx but 503/504), UNKNOWN or INTERNAL — except, for a
request through a router (--all), a 5xx or an error event in the stream within an outage of a process (its start
to its end + OUTAGE_SLACK_S): the router's way of saying the scheduler it picked went away (smg: "Stream error: h2
protocol error" when a scheduler is SIGKILLed mid-stream); that attempt is re-sent, like UNAVAILABLE, and counted
apart (routed_errors_in_outages). Outside an outage such an error event is a failure.
Text through a router is compared without trailing U+FFFD (a stream that ends inside a UTF-8 sequence: Tandem
flushes U+FFFD, smg holds the bytes back).

The longest stall is the longest time a streaming request went without a token (start, tokens, end; across
its retries), as measured, and outside the outages (a gap minus its overlap with any SIGKILL -> READY window).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from tests.soak.attempts import SHUTDOWN_ABORT
from tests.soak.clients import Record
from tests.soak.cluster import Outage

EXPECTED = ("completed", "cancelled", "disconnected", "adapter-not-found", "refused", "slow-stopped",
            "slow-completed")
EXPECTED_STATUSES = {"NOT_FOUND", "RESOURCE_EXHAUSTED", "CANCELLED"}  # an error event these name is an answer
OUTAGE_SLACK_S = 5.0  # a router's 5xx this long after an outage's end is still the outage's (its health probes)
ROUTES = ("smg", "vr")
FAILURE_STATUSES = {"UNKNOWN", "INTERNAL", "DATA_LOSS"}
UNAVAILABLE_SLACK_S = 3.0  # an UNAVAILABLE within this long of a scheduler outage's end is the outage's


def outcome(record: Record, references: dict) -> str:
    spec, last = record.spec, record.attempts[-1]
    if last.client_cancelled:
        return "disconnected" if spec.protocol != "grpc" else "cancelled"
    if spec.slow:
        if last.status == "RESOURCE_EXHAUSTED":
            return "slow-stopped"
        if last.status == "OK":
            return "slow-completed" if spec.protocol != "grpc" or len(last.tokens or ()) == last.max_tokens \
                else "wrong-answer"
    if last.status == "OK":
        if spec.protocol == "grpc":
            return "completed" if last.tokens == references.get(spec.key) else "wrong-answer"
        want = references.get(spec.key)
        if spec.route in ROUTES and isinstance(want, str):
            return "completed" if last.text.rstrip("\ufffd") == want.rstrip("\ufffd") else "wrong-answer"
        return "completed" if last.text == want else "wrong-answer"
    if last.status == "NOT_FOUND" and spec.adapter:
        return "adapter-not-found"
    if last.status == "RESOURCE_EXHAUSTED":
        return "refused"
    if last.status == "UNAVAILABLE":
        return "gave-up-unavailable"
    if last.status == SHUTDOWN_ABORT:
        return "gave-up-aborted"
    return f"status-{last.status}"


def is_failure(label: str, status: str) -> bool:
    if status in FAILURE_STATUSES:
        return True
    words = label.split()
    return len(words) == 2 and words[0] == "http" and words[1].isdigit() and int(words[1]) >= 500 \
        and int(words[1]) not in (503, 504)


def _overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in windows)


@dataclass
class Stall:
    seconds: float = 0.0
    request: str = ""
    at_s: float = 0.0  # since the load started


@dataclass
class Verdict:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    by_label: collections.Counter = field(default_factory=collections.Counter)  # request kind x outcome
    lost: list[dict] = field(default_factory=list)
    errors: collections.Counter = field(default_factory=collections.Counter)  # attempt labels, cancels apart
    failures: list[dict] = field(default_factory=list)
    retries: int = 0
    retried_requests: int = 0
    unavailable_outside_outages: list[dict] = field(default_factory=list)
    routed_errors_in_outages: collections.Counter = field(default_factory=collections.Counter)
    stall: Stall = field(default_factory=Stall)
    stall_outside: Stall = field(default_factory=Stall)
    leaked_blocks: int = 0
    leaked_caches: int = 0
    crashed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.lost and not self.failures and self.leaked_blocks == 0 and self.leaked_caches == 0 \
            and not self.crashed


def judge(records: list[Record], references: dict, outages: list[Outage], t0: float) -> Verdict:
    v = Verdict()
    windows = [(o.start, o.end or float("inf")) for o in outages]
    scheduler_windows = [(o.start, (o.end or float("inf")) + UNAVAILABLE_SLACK_S) for o in outages
                         if o.what.startswith(("scheduler", "smg", "vllm-router"))]
    any_windows = [(o.start, (o.end or float("inf")) + OUTAGE_SLACK_S) for o in outages]
    for rec in records:
        spec = rec.spec
        result = outcome(rec, references)
        v.outcomes[result] += 1
        v.by_label[(spec.label, result)] += 1
        if len(rec.attempts) > 1:
            v.retries += len(rec.attempts) - 1
            v.retried_requests += 1
        if result not in EXPECTED:
            last = rec.attempts[-1]
            v.lost.append({"request": spec.n, "kind": spec.label, "route": spec.route, "adapter": spec.adapter,
                           "seeded": spec.seeded, "tokens": None if last.tokens is None else len(last.tokens),
                           "max_tokens": last.max_tokens,
                           "prompt": spec.prompt, "outcome": result, "status": last.label, "detail": last.detail,
                           "attempts": len(rec.attempts), "at_s": round(last.started - t0, 3),
                           "ended_at_s": round(last.ended - t0, 3)})
        prev_end = None
        for att in rec.attempts:
            if not att.client_cancelled and att.status != "OK":
                v.errors[att.label] += 1
                routed_in_outage = spec.route in ROUTES and att.label.startswith(("http 5", "http sse")) \
                    and _overlap(att.started, att.ended, any_windows) > 0
                if routed_in_outage:
                    v.routed_errors_in_outages[att.label] += 1
                elif is_failure(att.label, att.status) or (spec.route in ROUTES and att.label.startswith("http sse")
                                                           and att.status not in EXPECTED_STATUSES):
                    v.failures.append({"request": spec.n, "kind": spec.label, "status": att.label,
                                       "detail": att.detail, "at_s": round(att.started - t0, 3)})
                if att.status in ("UNAVAILABLE", SHUTDOWN_ABORT) \
                        and _overlap(att.started, att.ended, scheduler_windows) == 0:
                    v.unavailable_outside_outages.append({"request": spec.n, "kind": spec.label, "status": att.label,
                                                          "detail": att.detail, "at_s": round(att.started - t0, 3)})
            gaps = list(att.gaps)
            if att.stream and prev_end is not None:
                gaps.append((prev_end, att.started))  # the pause before a retry is part of the stall
            prev_end = att.ended
            for a, b in gaps if att.stream and not spec.slow else ():  # (a slow reader's pause is its own)
                _note(v.stall, b - a, spec, a - t0)
                _note(v.stall_outside, (b - a) - _overlap(a, b, windows), spec, a - t0)
    return v


def _note(stall: Stall, seconds: float, spec, at: float) -> None:
    if seconds > stall.seconds:
        stall.seconds, stall.request, stall.at_s = seconds, f"#{spec.n} {spec.label}", at
