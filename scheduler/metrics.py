"""The scheduler's Prometheus metrics: request latencies, tokens and endings, and each executor's load.

One SchedulerMetrics per server, on a registry of its own (not prometheus_client's global one, so that
several schedulers can live in one test process). Names are vLLM's where they mean the same, with `tandem:`
for `vllm:` (dashboards and alerts written for vLLM carry over); docs/metrics.md lists them all.

Request figures are counted as they happen: each request's stream (scheduler/output/request_stream.py) reports its
admission, tokens and end through the RequestEvents hooks (scheduler/output/request_events.py) that SchedulerMetrics
implements, into plain counters and lock-free histograms (the event loop is their one writer) that
_RequestCollector exports when scraped. Queue lengths, KV usage and the per-executor counters the engines
keep anyway are read when scraped, as plain ExecutorStats from a callable the server hands over
(_ExecutorCollector), so the scheduling loop does no metrics work for them and nothing here reads an engine.

Exposed through render() (the HTTP front's GET /metrics) and, with --metrics-port, serve() (a plain
prometheus_client HTTP server, for a scheduler without the HTTP front).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.executor.info import ExecutorStats
from scheduler.fleet.kv_migration_metrics import KvMoveCollector, KvMoveCounters
from scheduler.compat.llmd_gauges import ModelServerCollector
from scheduler.output.step_outcome import Verified
from scheduler.request import FinishReason
from tandem.histogram import SingleWriterHistogram
from tandem.metrics_http import serve_metrics

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tandem.security.guard import ServerGuard

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that quantiles compare with vLLM's; inter-token latency also
# gets finer ones below vLLM's first (10 ms), where GPU decode steps fall.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ACCEPTED_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # accepted drafts per verification
# Why a request was refused for overload: queue full (--max-waiting), the wait estimated past
# --max-queue-time-s at arrival, that bound reached in the queue, the gRPC calls at --max-concurrent-rpcs, the
# HTTP front's connections at --http-max-connections / --http-max-connections-per-client.
REFUSAL_REASONS = ("queue_full", "queue_wait_estimate", "queue_time", "rpc_limit", "http_connections",
                   "http_connections_per_client")
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))[:-2]  # 1, 2, 5, 10, ... 1e6


class SchedulerMetrics:
    """What one scheduler process exports. The request hooks run on the event loop (the only writer: plain
    counters and tandem/histogram.py's lock-free histograms, ~1 us per token); a scrape may come from the
    metrics server's thread and only reads (copies)."""

    def __init__(self) -> None:
        self.ttft = SingleWriterHistogram(TTFT_BUCKETS)
        self.itl = SingleWriterHistogram(ITL_BUCKETS)
        self.e2e = SingleWriterHistogram(REQUEST_BUCKETS)
        self.queue_time = SingleWriterHistogram(REQUEST_BUCKETS)
        self.request_prompt_tokens = SingleWriterHistogram(TOKEN_BUCKETS)
        self.request_generation_tokens = SingleWriterHistogram(TOKEN_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.spec_drafts = 0  # speculative decoding: sequences' drafts verified, their tokens, those accepted
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_by_method: dict[str, list[int]] = {}  # method -> [drafts, draft tokens, accepted tokens]
        self.spec_accepted_per_pos: list[int] = []  # drafts (scheduler's) accepted at least as far as position i
        self.spec_accepted_length = SingleWriterHistogram(ACCEPTED_LENGTH_BUCKETS)
        self.spec_verify_s = 0.0  # time of steps that carried drafts
        self.success = {reason.value: 0 for reason in FinishReason}  # every series exists from the start
        self.failure: dict[str, int] = {}  # by gRPC status name
        self.stream_stalls = 0  # requests stopped because their clients left their streams unread
        # Overload refusals by reason (tandem.errors.Overloaded); the gRPC call limit's and the HTTP connection
        # caps' are read from them (their counts by reason)
        self.refusals: dict[str, int] = {reason: 0 for reason in REFUSAL_REASONS}
        self.call_limit: Callable[[], int] = lambda: 0
        self.connection_caps: Callable[[], Mapping[str, int]] = dict
        self.registry = CollectorRegistry()
        self.registry.register(_RequestCollector(self))
        self.kv_moves = KvMoveCounters()  # KV moved between executors, tokens recomputed where it was not
        self.registry.register(KvMoveCollector(self.kv_moves))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    def watch(self, executors: Callable[[], list[ExecutorStats]], model_name: str = "",
              prefix_caching: Callable[[], bool] = lambda: False) -> None:
        """Exports each executor's queue lengths, KV usage and counters, read from executors() when scraped,
        and the pod-level gauges under vLLM's names that llm-d reads (scheduler/compat/llmd_gauges.py)."""
        self.registry.register(_ExecutorCollector(executors))
        self.registry.register(ModelServerCollector(executors, model_name, prefix_caching))

    # ----------------------------------------------------------------- request lifecycle
    def admitted(self, queued_s: float) -> None:
        self.queue_time.observe(queued_s)

    def first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.generation_tokens += 1
        self.prompt_tokens += prompt_tokens
        self.prefix_queries += prompt_tokens
        self.prefix_hits += cached_tokens

    def next_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)
        self.generation_tokens += 1

    def finished(self, reason: FinishReason, e2e_s: float, prompt_tokens: int, generated_tokens: int) -> None:
        self.success[reason.value] += 1
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)

    def failed(self, code: str) -> None:
        self.failure[code] = self.failure.get(code, 0) + 1

    def speculated(self, verified: list[Verified], seconds: float) -> None:
        """A step of `seconds` verified these drafts."""
        self.spec_verify_s += seconds
        for v in verified:
            self.spec_drafts += v.steps
            self.spec_draft_tokens += v.drafted
            self.spec_accepted_tokens += v.accepted
            counts = self.spec_by_method.setdefault(v.method, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + v.steps, counts[1] + v.drafted, counts[2] + v.accepted
            if v.steps == 1:  # (a burst's drafts come summed: no positions, no lengths)
                self.spec_accepted_length.observe(v.accepted)
                while len(self.spec_accepted_per_pos) < v.drafted:
                    self.spec_accepted_per_pos.append(0)
                for pos in range(v.accepted):
                    self.spec_accepted_per_pos[pos] += 1

    def stalled(self) -> None:
        self.stream_stalls += 1

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def recomputed(self, tokens: int) -> None:
        self.kv_moves.recomputed_tokens += tokens

    def kv_transferred(self, num_bytes: int, seconds: float) -> None:
        self.kv_moves.transfer_bytes += num_bytes
        self.kv_moves.transfer_s.observe(seconds)

    def kv_transfer_failed(self) -> None:
        self.kv_moves.transfer_failures += 1

    def migrated(self) -> None:
        self.kv_moves.migrated += 1

    # ----------------------------------------------------------------- exposition
    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type (for GET /metrics)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, host: str, port: int, guard: "ServerGuard") -> "WSGIServer":
        """GET /metrics on host:port (0: any free port, logged) from a daemon thread, under the server's TLS and
        tokens (tandem/metrics_http.py); shutdown() the returned server to stop it."""
        return serve_metrics(self.registry, host, port, logging.getLogger("tandem.scheduler"), guard.tls,
                             guard.authenticator)


def _histogram(name: str, doc: str, hist: SingleWriterHistogram) -> HistogramMetricFamily:
    return hist.add_to(HistogramMetricFamily(name, doc))


class _RequestCollector(Collector):
    """The request figures SchedulerMetrics counted."""

    def __init__(self, m: SchedulerMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        yield _histogram("tandem:time_to_first_token_seconds",
                         "Time from queueing a request (after tokenizing) to its first generated token, in seconds.",
                         m.ttft)
        yield _histogram("tandem:inter_token_latency_seconds",
                         "Time between two consecutive tokens of a request, in seconds.", m.itl)
        yield _histogram("tandem:e2e_request_latency_seconds",
                         "Time from queueing a request to its last token, in seconds (finished requests).", m.e2e)
        yield _histogram("tandem:request_queue_time_seconds",
                         "Time a request waited in the queue before it was first admitted, in seconds.",
                         m.queue_time)
        yield _histogram("tandem:request_prompt_tokens", "Prompt tokens per finished request.",
                         m.request_prompt_tokens)
        yield _histogram("tandem:request_generation_tokens", "Generated tokens per finished request.",
                         m.request_generation_tokens)
        yield CounterMetricFamily("tandem:prompt_tokens", "Prompt tokens of requests that got a first token.",
                                  value=m.prompt_tokens)
        yield CounterMetricFamily("tandem:generation_tokens", "Tokens generated.", value=m.generation_tokens)
        yield CounterMetricFamily("tandem:prefix_cache_queries", "Prompt tokens of requests that got a first "
                                  "token (looked up in the executor's prefix cache).", value=m.prefix_queries)
        yield CounterMetricFamily("tandem:prefix_cache_hits", "Of those, tokens the executor's prefix cache "
                                  "served (usage.cached_tokens).", value=m.prefix_hits)
        yield CounterMetricFamily("tandem:spec_decode_num_drafts", "Drafts verified (one per sequence and step "
                                  "that carried draft tokens).", value=m.spec_drafts)
        yield CounterMetricFamily("tandem:spec_decode_num_draft_tokens", "Draft tokens sent to executors for "
                                  "verification (--speculative).", value=m.spec_draft_tokens)
        yield CounterMetricFamily("tandem:spec_decode_num_accepted_tokens", "Of those, tokens the model accepted "
                                  "(each saved a decode step).", value=m.spec_accepted_tokens)
        yield from _speculation(m)
        yield CounterMetricFamily("tandem:stream_stalls", "Requests stopped (KV freed) because their client left "
                                  "the stream unread past --stream-stall-timeout-s or --stream-max-buffered.",
                                  value=m.stream_stalls)
        refused = CounterMetricFamily("tandem:requests_refused", "Requests refused for overload before any of "
                                      "them ran (429 / RESOURCE_EXHAUSTED with Retry-After), by reason: queue_full "
                                      "(--max-waiting), queue_wait_estimate (the measured drain rate put the wait "
                                      "past --max-queue-time-s), queue_time (that bound reached in the queue), "
                                      "rpc_limit (--max-concurrent-rpcs), http_connections / "
                                      "http_connections_per_client (the HTTP front's connection caps: 503 / 429).",
                                      labels=["reason"])
        counts = dict(m.refusals)
        counts["rpc_limit"] = counts.get("rpc_limit", 0) + m.call_limit()
        for reason, n in dict(m.connection_caps()).items():
            counts[reason] = counts.get(reason, 0) + n
        for reason, n in sorted(counts.items()):
            refused.add_metric([reason], n)
        yield refused
        success = CounterMetricFamily("tandem:request_success", "Requests that finished, by finish reason.",
                                      labels=["finished_reason"])
        for reason, n in dict(m.success).items():
            success.add_metric([reason], n)
        failure = CounterMetricFamily("tandem:request_failure", "Requests that ended with an error, by gRPC "
                                      "status name (CANCELLED: the client went away).", labels=["code"])
        for code, n in sorted(dict(m.failure).items()):  # (a copy: the event loop may add a code meanwhile)
            failure.add_metric([code], n)
        yield from (success, failure)


class _ExecutorCollector(Collector):
    """Per executor (label `executor`: its address): requests running and waiting, KV usage, whether it
    serves, and the counters its engine keeps (step calls, preemptions, losses)."""

    def __init__(self, executors: Callable[[], list[ExecutorStats]]) -> None:
        self.executors = executors

    def collect(self) -> Iterator[Metric]:
        labels = ["executor"]
        running = GaugeMetricFamily("tandem:num_requests_running", "Requests in the running batch.", labels=labels)
        waiting = GaugeMetricFamily("tandem:num_requests_waiting",
                                    "Requests queued (new or preempted) for admission.", labels=labels)
        kv = GaugeMetricFamily("tandem:kv_cache_usage_perc",
                               "Fraction of the executor's KV blocks held by caches (0 to 1), as of its last "
                               "answer.", labels=labels)
        up = GaugeMetricFamily("tandem:scheduler_executor_up",
                               "1 while the executor serves this scheduler, 0 while it is lost or refused.",
                               labels=labels)
        preemptions = CounterMetricFamily("tandem:num_preemptions",
                                          "Running requests preempted (cache released, recomputed later) to free "
                                          "KV blocks.", labels=labels)
        steps = CounterMetricFamily("tandem:scheduler_steps", "Batches (UnifiedDecode calls) that ran.",
                                    labels=labels)
        losses = CounterMetricFamily("tandem:scheduler_executor_losses",
                                     "Times the executor was lost (no answer, restarted, session forgotten); its "
                                     "requests were recomputed.", labels=labels)
        masks = CounterMetricFamily("tandem:scheduler_token_masks", "Token masks computed for constrained "
                                    "(structured-output) requests.", labels=labels)
        mask_s = CounterMetricFamily("tandem:scheduler_token_mask_seconds", "Time the mask thread spent computing "
                                     "them, in seconds (overlapped with the scheduling loop's own work).",
                                     labels=labels)
        mask_wait = CounterMetricFamily("tandem:scheduler_token_mask_wait_seconds", "Time the scheduling loop "
                                        "waited for token masks before sending a step, in seconds (what steps "
                                        "paid for them).", labels=labels)
        for view in self.executors():
            name = [view.address]
            running.add_metric(name, view.running)
            waiting.add_metric(name, view.waiting)
            used = view.kv_total_blocks - view.kv_free_blocks
            kv.add_metric(name, used / view.kv_total_blocks if view.kv_total_blocks else 0.0)
            up.add_metric(name, 1.0 if view.state == "serving" else 0.0)
            preemptions.add_metric(name, view.preemptions)
            steps.add_metric(name, view.step_calls)
            losses.add_metric(name, view.losses)
            masks.add_metric(name, view.masks)
            mask_s.add_metric(name, view.mask_compute_s)
            mask_wait.add_metric(name, view.mask_wait_s)
        yield from (running, waiting, kv, up, preemptions, steps, losses, masks, mask_s, mask_wait)


def _speculation(m: SchedulerMetrics) -> Iterator[Metric]:
    """Speculative decoding by method, the acceptance lengths and verification time, and the same totals under
    vLLM's names (vllm/v1/spec_decode/metrics.py, v0.10: dashboards computing acceptance rate and mean acceptance
    length from them work unchanged)."""
    by_method = {k: list(v) for k, v in m.spec_by_method.items()}  # (a copy: the event loop may add one)
    names = (("drafts", "Drafts verified"), ("draft_tokens", "Draft tokens verified"),
             ("accepted_tokens", "Draft tokens accepted"))
    for i, (name, text) in enumerate(names):
        fam = CounterMetricFamily(f"tandem:spec_decode_{name}_by_method", f"{text}, by where the drafts came from "
                                  "(ngram: the request's own tokens; suffix: earlier requests' outputs; ngram_burst: "
                                  "the executor's, within multi-step bursts; draft_model: the executor's draft "
                                  "model).", labels=["method"])
        for method, counts in sorted(by_method.items()):
            fam.add_metric([method], counts[i])
        yield fam
    yield _histogram("tandem:spec_decode_acceptance_length", "Draft tokens accepted per verification of a "
                     "scheduler-made draft.", m.spec_accepted_length)
    yield CounterMetricFamily("tandem:spec_decode_verify_seconds", "Time of the steps that verified drafts (the "
                              "whole step: its other sequences' tokens too).", value=m.spec_verify_s)
    yield CounterMetricFamily("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", value=m.spec_drafts)
    yield CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                              value=m.spec_draft_tokens)
    yield CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                              value=m.spec_accepted_tokens)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=["position"])
    for pos, n in enumerate(list(m.spec_accepted_per_pos)):
        per_pos.add_metric([str(pos)], n)
    yield per_pos
