"""The executor's Prometheus metrics (--metrics-port): step latency and size, KV blocks, prefix cache,
adapters, the draft model, MoE expert load, memory.

Two sources, so that the model thread does (almost) nothing for them:
- step histograms, observed once per packed forward (ExecutorMetrics.record_step calls observe_step: two
  lock-free observations per call, tandem/histogram.py, never per token);
- everything else read when scraped (_ExecutorCollector) from what the executor already counts for GetMetrics:
  the same reads GetMetrics makes, without the model lock (they never wait for a model call).

One registry per exporter (not prometheus_client's global one). Names start `tandem:executor_`; the README
lists them all.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                    Metric, SummaryMetricFamily)
from prometheus_client.registry import Collector

from executor_service.metrics.draft_model import draft_model_metrics
from executor_service.metrics.op_stats import RpcMetrics
from executor_service.metrics.kv_movement import tier_metrics, transfer_metrics
from executor_service.metrics.op_stats import LatencySummary
from executor_service.model_thread import ModelThread
from tandem.histogram import SingleWriterHistogram
from tandem.metrics_http import serve_metrics

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tandem.security.guard import ServerGuard

    from executor_service.executor import Executor
    from executor_service.kv.events.zmq_publisher import ZmqKvStats

STEP_KINDS = ("prefill", "decode", "mixed", "verify")
# From a fast GPU decode step (well under a millisecond) to a long CPU prefill.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25,
                        0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_TOKENS_BUCKETS = tuple(float(2 ** i) for i in range(15))  # 1 ... 16384


class ExecutorExporter:
    def __init__(self, rpc_metrics: RpcMetrics, thread: ModelThread) -> None:
        self.registry = CollectorRegistry()
        self.steps = {k: (SingleWriterHistogram(STEP_SECONDS_BUCKETS), SingleWriterHistogram(STEP_TOKENS_BUCKETS))
                      for k in STEP_KINDS}
        self.executor: Executor | None = None  # until the model is loaded: only what needs no executor
        self.kv_events_zmq: Callable[[], ZmqKvStats] | None = None  # the ZMQ KV event publisher's counters
        self.registry.register(_ExecutorCollector(self, rpc_metrics, thread))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    def attach(self, executor: "Executor") -> None:
        """The loaded executor: its steps are observed from now on, its state is exported."""
        self.executor = executor
        executor.metrics.step_observer = self.observe_step

    def observe_step(self, kind: str, seconds: float, tokens: int) -> None:
        seconds_hist, tokens_hist = self.steps[kind]
        seconds_hist.observe(seconds)
        tokens_hist.observe(tokens)

    def serve(self, host: str, port: int, guard: "ServerGuard") -> "WSGIServer":
        """GET /metrics on host:port (0: any free port, logged) from a daemon thread, under the server's TLS and
        tokens (tandem/metrics_http.py); shutdown() the returned server to stop it."""
        return serve_metrics(self.registry, host, port, logging.getLogger("tandem.executor"), guard.tls,
                             guard.authenticator)


def _summary(name: str, doc: str, label: str, stats: dict[str, LatencySummary]) -> SummaryMetricFamily:
    family = SummaryMetricFamily(name, doc, labels=[label])
    for key, s in sorted(stats.items()):
        family.add_metric([key], s.count, s.mean_ms * s.count / 1e3)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _ExecutorCollector(Collector):
    def __init__(self, exporter: ExecutorExporter, rpc_metrics: RpcMetrics, thread: ModelThread) -> None:
        self.exporter = exporter
        self.rpc_metrics = rpc_metrics
        self.thread = thread

    def collect(self) -> Iterator[Metric]:
        seconds = HistogramMetricFamily("tandem:executor_step_duration_seconds", "Time of one packed forward (KV "
                                        "reserved to tokens sampled), by kind.", labels=["kind"])
        tokens = HistogramMetricFamily("tandem:executor_step_tokens", "Tokens written by one packed forward (all "
                                       "items together), by kind.", labels=["kind"])
        for kind, (seconds_hist, tokens_hist) in self.exporter.steps.items():
            seconds_hist.add_to(seconds, [kind])
            tokens_hist.add_to(tokens, [kind])
        yield from (seconds, tokens)
        yield _gauge("tandem:executor_queued_calls", "Model calls waiting behind the one running.",
                     self.thread.queued())
        yield _summary("tandem:executor_rpc_duration_seconds", "gRPC calls and their time as the server saw them, "
                       "by method.", "method", self.rpc_metrics.snapshot())
        ex = self.exporter.executor
        if ex is None:
            return
        yield from self._identity(ex)
        snap = ex.metrics_snapshot()
        yield _summary("tandem:executor_operation_duration_seconds", "Executor operations and their time, model "
                       "lock wait included, by operation.", "operation", snap.ops)
        wait = SummaryMetricFamily("tandem:executor_model_lock_wait_seconds",
                                   "Time operations waited for the model lock.", count_value=snap.lock_wait.count,
                                   sum_value=snap.lock_wait.mean_ms * snap.lock_wait.count / 1e3)
        yield wait
        yield _counter("tandem:executor_forward_passes", "Packed model forwards run.", snap.forward_passes)
        yield _counter("tandem:executor_tokens_processed", "Tokens written through the model (prompt chunks, "
                       "decode tokens, verified drafts).", snap.tokens_processed)
        yield _counter("tandem:executor_tokens_sampled", "Tokens sampled.", snap.tokens_sampled)
        yield _counter("tandem:executor_caches_created", "Caches created.", snap.caches_created)
        yield _counter("tandem:executor_caches_released", "Caches freed by ReleaseCache.", snap.caches_released)
        yield _gauge("tandem:executor_resident_memory_bytes", "Resident memory (RSS) of the executor process.",
                     snap.resident_memory_bytes)
        yield from self._kv(ex)
        tiers = ex.prefix.tiers
        if tiers is not None:
            yield from tier_metrics(tiers.stats(), tiers.store.dropped)
        yield from transfer_metrics(ex.transfer.stats())
        yield from self._adapters(ex)
        yield from draft_model_metrics(ex.info().draft_model if ex.draft is not None else None)  # (GetInfo's view)
        if self.exporter.kv_events_zmq is not None:
            yield from _zmq_events(self.exporter.kv_events_zmq())
        yield from self._experts(ex)
        if ex.device.type == "cuda":
            yield _gauge("tandem:executor_device_memory_allocated_bytes", "CUDA memory held by tensors.",
                         torch.cuda.memory_allocated(ex.device))
            yield _gauge("tandem:executor_device_memory_reserved_bytes", "CUDA memory held by torch's caching "
                         "allocator (allocated + cached for reuse).", torch.cuda.memory_reserved(ex.device))

    @staticmethod
    def _identity(ex: "Executor") -> Iterator[Metric]:
        info = InfoMetricFamily("tandem:executor", "The model this executor serves, and where.")
        dtype = str(ex.model.lm_head.weight.dtype).removeprefix("torch.")
        info.add_metric([], {"model": ex.config.model_dir.name, "architecture": ex.model_config.architecture,
                             "device": str(ex.device), "dtype": dtype, "instance_id": ex.instance_id})
        yield info

    @staticmethod
    def _kv(ex: "Executor") -> Iterator[Metric]:
        kv = ex.kv_usage()
        yield _gauge("tandem:executor_kv_total_blocks", "Blocks in the KV pool.", kv.total_blocks)
        yield _gauge("tandem:executor_kv_free_blocks", "KV blocks not held by any cache (cached ones included).",
                     kv.free_blocks)
        yield _gauge("tandem:executor_kv_cached_blocks", "Of the free KV blocks, those holding a cached prompt "
                     "prefix (reusable; evicted least recently used first).", kv.cached_blocks)
        yield _gauge("tandem:executor_kv_used_blocks", "KV blocks held by caches.", kv.total_blocks - kv.free_blocks)
        yield _gauge("tandem:executor_kv_block_size_tokens", "Tokens per KV block.", kv.block_size)
        yield _gauge("tandem:executor_active_caches", "Caches held.", kv.active_caches)
        p = ex.prefix_stats()
        yield _counter("tandem:executor_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                       "(CreateCache).", p.query_tokens)
        yield _counter("tandem:executor_prefix_cache_hits", "Of those, tokens served from cached blocks.",
                       p.hit_tokens)
        yield _counter("tandem:executor_prefix_cache_stored_blocks", "Full blocks added to the prefix index.",
                       p.stored_blocks)
        yield _counter("tandem:executor_prefix_cache_evicted_blocks", "Cached blocks evicted (taken for other "
                       "data).", p.evicted_blocks)
        yield _gauge("tandem:executor_prefix_cache_indexed_blocks", "Blocks in the prefix index (held or "
                     "evictable).", p.indexed_blocks)

    @staticmethod
    def _adapters(ex: "Executor") -> Iterator[Metric]:
        adapters = ex.list_adapters()
        yield _gauge("tandem:executor_adapters_loaded", "LoRA adapters loaded.", len(adapters))
        yield _gauge("tandem:executor_adapters_on_device", "Loaded LoRA adapters whose weights are on the device.",
                     sum(a.on_device for a in adapters))
        requests = CounterMetricFamily("tandem:executor_adapter_requests", "Items served with the adapter.",
                                       labels=["adapter"])
        loads = CounterMetricFamily("tandem:executor_adapter_loads", "Moves of the adapter's weights to the device.",
                                    labels=["adapter"])
        evictions = CounterMetricFamily("tandem:executor_adapter_evictions",
                                        "Evictions of the adapter's weights to host memory.", labels=["adapter"])
        for a in adapters:
            requests.add_metric([a.name], a.requests)
            loads.add_metric([a.name], a.loads)
            evictions.add_metric([a.name], a.evictions)
        yield from (requests, loads, evictions)

    @staticmethod
    def _experts(ex: "Executor") -> Iterator[Metric]:
        load = ex.expert_load()
        if not load:  # a dense model
            return
        family = CounterMetricFamily("tandem:executor_moe_expert_tokens", "Tokens routed to the expert, per MoE "
                                     "layer (load balance).", labels=["layer", "expert"])
        for layer, tokens in sorted(load.items()):
            for expert, n in enumerate(tokens):
                family.add_metric([str(layer), str(expert)], n)
        yield family


def _zmq_events(z: "ZmqKvStats") -> Iterator[Metric]:
    yield _counter("tandem:executor_kv_events_zmq_batches", "KV event batches published on ZMQ "
                   "(--kv-events-endpoint).", z.published_batches)
    yield _counter("tandem:executor_kv_events_zmq_events", "KV events published on ZMQ (AllBlocksCleared markers "
                   "included).", z.published_events)
    yield _counter("tandem:executor_kv_events_zmq_dropped", "KV events dropped before ZMQ: the publisher's queue "
                   "was full (an AllBlocksCleared marks the spot).", z.dropped_events)
    yield _counter("tandem:executor_kv_events_zmq_replays", "Replay requests answered "
                   "(--kv-events-replay-endpoint).", z.replay_requests)
    yield _gauge("tandem:executor_kv_events_zmq_queued", "KV events waiting for the ZMQ publisher thread.",
                 z.queued)
