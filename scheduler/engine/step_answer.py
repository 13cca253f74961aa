"""What one step call gave the engine (scheduler/engine/engine.py): the executor's answer per item, its KV usage and
the call's time; and the one question the engine asks of an answer without sessions (an unknown cache)."""
from __future__ import annotations

from typing import NamedTuple

from scheduler.engine.planner import StepPlan
from scheduler.engine.step_outcome import ItemResult
from tandem.errors import RemoteError
from tandem.kv_usage import KvUsage


class StepAnswer(NamedTuple):
    results: list[ItemResult]  # the step call's answer, per item
    kv: KvUsage
    elapsed_s: float


def names_unknown_cache(plan: StepPlan, results: list[ItemResult]) -> bool:
    """Whether an item that named an existing cache failed NOT_FOUND (the executor no longer holds it)."""
    return any(isinstance(r.error, RemoteError) and r.error.status_name == "NOT_FOUND" and item.seq.cache_id
               for item, r in zip(plan.items, results))
