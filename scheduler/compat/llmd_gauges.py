"""vLLM's own gauge names, for routers that read a model server's load by them: llm-d's endpoint picker (the
Gateway API Inference Extension's model-server protocol) scores pods from `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:lora_requests_info` and
`vllm:cache_config_info`, read from the pod's /metrics.

A scheduler is one pod: each gauge is one series for all its executors together (summed; the KV usage is
blocks held over blocks in all pools), because the picker reads one value per metric name and a pod with a
series per executor would hand it an arbitrary one. Meanings are vLLM's (v1 engine, vllm/v1/metrics/
loggers.py): running = requests in the batch, waiting = requests queued (preempted ones included), KV usage
= 1 - free/total blocks where blocks holding only a cached prefix count as free (vLLM's block pool counts
evictable cached blocks free too). `lora_requests_info` is a gauge whose value is the time of the update
(the picker takes the series with the latest value) and whose labels carry the adapters, comma-joined;
it exists, as in vLLM, only when adapters can be served. The labels `model_name` (the first served model
name) and `engine` ("0") are vLLM's. The per-executor `tandem:` series stay beside these (scheduler/metrics.py).
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.executor.info import ExecutorStats


class ModelServerCollector(Collector):
    """The five gauges of llm-d's model-server protocol, from the executors' stats when scraped."""

    def __init__(self, executors: Callable[[], list[ExecutorStats]], model_name: str,
                 prefix_caching: Callable[[], bool],
                 clock: Callable[[], float] = time.time) -> None:
        self.executors = executors
        self.model_name = model_name
        self.prefix_caching = prefix_caching
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        views = self.executors()
        labels, values = ["model_name", "engine"], [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        counted = [v for v in views if v.kv_total_blocks]  # a pool not yet known says nothing
        total = sum(v.kv_total_blocks for v in counted)
        used = sum(v.kv_total_blocks - v.kv_free_blocks for v in counted)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    sum(v.running for v in views))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    sum(v.waiting for v in views))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    used / total if total else 0.0)
        config = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=[*labels, "block_size", "num_gpu_blocks", "enable_prefix_caching"])
        block_size = max((v.block_size for v in counted), default=0)
        config.add_metric([*values, str(block_size), str(total), str(self.prefix_caching())], 1.0)
        yield config
        max_lora = max((v.max_adapters for v in views), default=0)
        if max_lora:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            running = sorted({a for v in views for a in v.running_adapters})
            waiting = sorted({a for v in views for a in v.waiting_adapters})
            lora.add_metric([str(max_lora), ",".join(waiting), ",".join(running)], self.clock())
            yield lora
