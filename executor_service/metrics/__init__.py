"""The executor's metrics: operation stats, Prometheus families, KV-movement counters."""
