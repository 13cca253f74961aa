"""Prefill and decode executors (each executor's --role, read from GetInfo): which executors a request may go
to in each phase, and the hand-off from a prefill executor once a request's prompt is done.

- phase "prompt" (a new request, or one to recompute from its prompt): executors of role prefill or both;
- phase "decode" (a request that has its first token): executors of role decode or both.
When no serving executor has a fitting role, any serving one takes it (a fleet of prefill executors only still
decodes; one without prefill executors still runs prompts). Executors that declare no role are "both", so a
fleet that names no role routes exactly as before. Draining executors (scheduler/fleet/kv_migration.py) take nothing.

The hand-off: after each step of a prefill executor, its requests whose prompt is done (they have sampled
their first token and wait to write it) move to a decode executor with their KV (KvMigration.hand_off: the
decode executor pulls the cache, the prefill executor's copy is released); a transfer that fails recomputes
the request there. Among the candidates of a phase the router scores as always (prefix hits, free KV, load).
"""
from __future__ import annotations

from typing import Collection, Iterable

from scheduler.engine.engine import Engine
from scheduler.fleet.kv_migration import KvMigration

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
PHASE_ROLE = {"prompt": PREFILL, "decode": DECODE}


def eligible(engines: Iterable[Engine], phase: str, draining: Collection[Engine],
             avoid: Engine | None = None) -> list[Engine]:
    """The serving engines a request in this phase may go to (none: only draining or avoided ones serve)."""
    pool = [e for e in engines if e is not avoid and e not in draining]
    fitting = [e for e in pool if e.info.role in (PHASE_ROLE[phase], BOTH)]
    return fitting or pool


def hand_off_prompts_done(engine: Engine, migration: KvMigration) -> None:
    """Called after each step of engine: on a prefill executor, the requests whose prompt is done move to a
    decode executor (those with nowhere to go decode here)."""
    if engine.info.role != PREFILL or engine.closed:
        return
    if not any(e.up and e.info.role in (DECODE, BOTH) and e not in migration.draining for e in migration.engines()):
        return
    done = [s for s in engine.policy.running if s.output_ids and s.is_decoding]
    if done:
        migration.hand_off(engine, done, "decode")
