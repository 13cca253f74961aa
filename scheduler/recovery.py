"""The executor's loss and return, on behalf of the engine (scheduler/engine.py).

Lost — the transport failed, a step got no answer in time, the instance id changed, or the executor forgot
our session: its caches are gone or unknowable, so every running request is requeued to be recomputed
(policy.executor_lost: outputs kept, nothing fails), health turns NOT_SERVING, and a task polls GetInfo.
New requests are still queued while the retry window (cfg.executor_retry_s, from the loss) lasts; past it
every queued request ends UNAVAILABLE and new ones fail at once until an executor serves again.

Back — an executor answers GetInfo: it must serve what the scheduler relies on (model, vocabulary, EOS ids,
maximum length: the tokenizer and every queued sequence were built for them), else the queue fails clearly
and polling goes on. If it is the same process (same instance id), what the lost one may still hold is freed
(the old session closed, or without sessions the forgotten caches released); a new session is opened; the
token budget and adapter slots it reports are adopted; queued requests whose adapter it lacks end NOT_FOUND;
queue clocks restart (the outage does not count against --max-queue-time); the loop runs again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from scheduler.executor_client import ExecutorUnreachable
from tandem.codec import kv_usage_from_pb
from tandem.errors import RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb

if TYPE_CHECKING:
    from scheduler.engine import Engine

log = logging.getLogger("tandem.scheduler")


class Recovery:
    def __init__(self, engine: Engine, on_health: Callable[[bool], None]) -> None:
        self.engine = engine
        self.losses = 0  # losses so far: a step that answers after one has nothing to apply
        self.refusal = ""  # while down: why new requests fail at once ("" = they are queued)
        self.reason = ""  # while down: why it was lost
        self.unfit = ""  # while down: why the executor that answers cannot be used (another model...)
        self._on_health = on_health
        self._down_since = 0.0
        self._lost_session = ""  # the lost executor's session: closed if that same process answers again
        self._task: asyncio.Task | None = None

    def lost(self, reason: str) -> None:
        e = self.engine
        if not e.up:
            return
        requeued = e.policy.executor_lost()
        e.up = False
        self.reason = reason
        self.losses += 1
        self._down_since = e.clock()
        self.refusal = ""
        self._lost_session, e.session.id = e.session.id, ""
        log.error("%s; %d running and %d queued requests wait up to %g s (--executor-retry-s) for it to serve "
                  "again, then are recomputed", reason, requeued, len(e.policy.waiting) - requeued,
                  e.cfg.executor_retry_s)
        self._on_health(False)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._reconnect(), name="reconnect")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _check_retry_window(self) -> None:
        e = self.engine
        if self.refusal or e.clock() - self._down_since < e.cfg.executor_retry_s:
            return
        self.refusal = (f"executor {e.client.address} did not serve again within {e.cfg.executor_retry_s:g} s "
                        "(--executor-retry-s); the scheduler serves again once it is back")
        failed = e.policy.fail_all(ExecutorUnreachable(self.refusal))
        log.error("%s: %d requests end UNAVAILABLE", self.refusal, len(failed))
        e.fail(failed)

    async def _reconnect(self) -> None:
        e = self.engine
        first = True
        while not e.closed:
            if not first:
                wait = e.cfg.reconnect_interval_s
                if not self.refusal:  # wake at the end of the window, not up to an interval later
                    wait = min(wait, max(0.0, self._down_since + e.cfg.executor_retry_s - e.clock()))
                await asyncio.sleep(wait)
            first = False
            self._check_retry_window()
            try:
                info = await e.client.info()
            except (ExecutorUnreachable, RemoteError):
                continue
            if await self._back(info):
                return

    async def _back(self, info: epb.GetInfoResponse) -> bool:
        """False: the executor that answers cannot be used (yet); keep polling."""
        e = self.engine
        unfit = unfit_reason(e.info, info, e.client.address)
        if unfit:
            if unfit != self.refusal:
                log.error("%s", unfit)
            self.refusal = self.unfit = unfit
            e.fail(e.policy.fail_all(Unavailable(unfit)))
            return False
        stale = e.policy.take_stale()
        same_process = info.instance_id == e.info.instance_id  # "" == "": unknown, so it may be
        try:
            if same_process and self._lost_session:
                await e.client.close_session(self._lost_session)  # frees every cache the old session held
            elif same_process and stale:
                await e.client.release(stale)  # unknown ids are no error
            self._lost_session = ""
            await e.session.open(info.session_ttl_ms)
        except (ExecutorUnreachable, RemoteError) as exc:
            e.policy.keep_stale(stale)
            log.warning("executor %s answers but cannot be used yet: %s", e.client.address, exc)
            return False
        e.info = info
        e.policy.reconfigure(kv_usage_from_pb(info.kv), info.max_batch_tokens, info.max_adapters_on_device)
        e.fail(e.policy.drop_missing_adapters(set(info.adapters)))
        e.policy.restart_queue_clocks()
        e.up, self.refusal, self.reason, self.unfit = True, "", "", ""
        self._on_health(True)
        log.info("executor %s serves again (%d KV blocks free, session %s); %d requests to recompute or run",
                 e.client.address, e.policy.kv.free_blocks, e.session.id or "(none)", len(e.policy.waiting))
        e.wake()
        return True


def unfit_reason(was: epb.GetInfoResponse, now: epb.GetInfoResponse, address: str) -> str:
    """Why an executor that answers again cannot continue the scheduler's requests ("" = it can)."""
    for what, old, new in (("model", was.model_id, now.model_id), ("model directory", was.model_dir, now.model_dir),
                           ("vocabulary size", was.vocab_size, now.vocab_size),
                           ("EOS token ids", list(was.eos_token_ids), list(now.eos_token_ids)),
                           ("maximum sequence length", was.max_seq_len, now.max_seq_len)):
        if old != new:
            shown = "" if what == "model directory" else f" ({new} instead of {old})"  # no host paths
            return f"executor {address} came back with another {what}{shown}; restart the scheduler to serve it"
    return ""
