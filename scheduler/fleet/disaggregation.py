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
the request there. Only decode executors that can import the prefill executor's KV are candidates (both move KV,
capability kv_transfer, and their KV fingerprints — weights, KV dtype, block size, layout — are equal: a
tensor-parallel executor's never equals another's); with none, the request decodes where its prompt ran, rather
than fail a transfer and compute its prompt again. Among the candidates of a phase the router scores as always
(prefix hits, free KV, load).
"""
from __future__ import annotations

from typing import Collection, Iterable

from scheduler.engine.engine import Engine
from scheduler.executor.info import ExecutorInfo
from scheduler.fleet.kv_migration import KvMigration
from tandem.capabilities import KV_TRANSFER

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
PHASE_ROLE = {"prompt": PREFILL, "decode": DECODE}


def eligible(engines: Iterable[Engine], phase: str, draining: Collection[Engine],
             avoid: Engine | None = None) -> list[Engine]:
    """The serving engines a request in this phase may go to (none: only draining or avoided ones serve)."""
    pool = [e for e in engines if e is not avoid and e not in draining]
    fitting = [e for e in pool if e.info.role in (PHASE_ROLE[phase], BOTH)]
    return fitting or pool


def kv_can_move(src: ExecutorInfo, dst: ExecutorInfo) -> bool:
    """Whether dst can import src's caches: both move KV and their KV layouts are the same (an executor that
    states no fingerprint, an older one, is tried: its import checks the source's header itself)."""
    if KV_TRANSFER not in src.capabilities or KV_TRANSFER not in dst.capabilities:
        return False
    return not src.kv_fingerprint or not dst.kv_fingerprint or src.kv_fingerprint == dst.kv_fingerprint


def by_kv(engines: list[Engine], src: Engine, kv: str) -> list[Engine]:
    """Of these candidates for a request leaving src: kv "none" (it holds no cache) all of them; "prefer" (it
    moves with its cache, or is recomputed) those that can import src's KV if any can, else all; "only" (a
    hand-off it may do without) only those."""
    if kv == "none":
        return engines
    movable = [e for e in engines if kv_can_move(src.info, e.info)]
    return movable if movable or kv == "only" else engines


def hand_off_prompts_done(engine: Engine, migration: KvMigration) -> None:
    """Called after each step of engine: on a prefill executor, the requests whose prompt is done move to a
    decode executor that can import their KV (those with nowhere to go decode here)."""
    if engine.info.role != PREFILL or engine.closed:
        return
    if not any(e.up and e.info.role in (DECODE, BOTH) and e not in migration.draining and e is not engine
               and kv_can_move(engine.info, e.info) for e in migration.engines()):
        return
    done = [s for s in engine.policy.running if s.output_ids and s.is_decoding]
    if done:
        migration.hand_off(engine, done, "decode", "only")
