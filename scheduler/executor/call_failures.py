"""What a failed executor call means, decided in one place for every call the engine makes.

- LOST: the executor is lost and its caches with it (or unknowable): the transport failed, a step got no
  answer in time (whether it ran is unknown), or the executor forgot our session (NOT_FOUND on a call naming
  it: expired, or a restart). Recovery requeues everything for recompute (scheduler/engine/recovery.py).
- CHECK_RESTART: a step NOT_FOUND without a session: unknown caches may mean a restart; GetInfo's instance
  id tells.
- KV_FULL: the executor's KV pool had no room for the step (blocks held by another client): preempt and
  plan again.
- RETRY: a slow or failed control call (GetInfo, KeepAlive, a ReleaseCache answered late): nothing ends; it
  is tried again.
- FAILED: any other error: a step's error ends the step's requests; a CreateCache error only means no
  reused prefix; a ReleaseCache error is logged.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from scheduler.executor.client import ExecutorUnreachable, is_kv_exhaustion
from tandem.errors import RemoteError


class Verdict(enum.Enum):
    LOST = "lost"
    CHECK_RESTART = "check_restart"
    KV_FULL = "kv_full"
    RETRY = "retry"
    FAILED = "failed"


class Call(enum.Enum):
    """The engine's calls to an executor."""

    STEP = "step"  # UnifiedDecode or Decode
    CREATE_CACHE = "CreateCache"
    RELEASE = "ReleaseCache"
    KEEP_ALIVE = "KeepAlive"
    INFO = "GetInfo"


@dataclass(frozen=True)
class CallFailure:
    verdict: Verdict
    reason: str  # for the log, and the loss's reason when LOST


def classify(exc: ExecutorUnreachable | RemoteError, call: Call, address: str, session_open: bool) -> CallFailure:
    """session_open: the call named the scheduler's session (so NOT_FOUND of the whole call means the
    executor no longer knows it)."""
    if isinstance(exc, ExecutorUnreachable):
        return CallFailure(Verdict.LOST, str(exc))
    status = exc.status_name
    if status == "NOT_FOUND" and session_open and call is not Call.INFO:
        return CallFailure(Verdict.LOST, f"executor {address} no longer knows this scheduler's session (expired, "
                                         f"or the executor restarted): {exc}")
    if call is Call.STEP:
        if status == "DEADLINE_EXCEEDED":
            return CallFailure(Verdict.LOST, f"a step got no answer from executor {address} in time ({exc})")
        if status == "NOT_FOUND":
            return CallFailure(Verdict.CHECK_RESTART, str(exc))
        if is_kv_exhaustion(exc):
            return CallFailure(Verdict.KV_FULL, str(exc))
        return CallFailure(Verdict.FAILED, str(exc))
    if call in (Call.INFO, Call.KEEP_ALIVE) or (call is Call.RELEASE and status == "DEADLINE_EXCEEDED"):
        return CallFailure(Verdict.RETRY, f"{call.value} answered {exc}")
    return CallFailure(Verdict.FAILED, f"{call.value} answered {exc}")
