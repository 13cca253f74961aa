"""An executor's loss and return, for one engine (scheduler/engine/engine.py). It owns the executor's up/down
state and the reconnect task, and receives only what it needs: the client, the session, the policy, the
configuration and the engine's callbacks for what changes with the executor (its info, the streams to fail).

Lost — the transport failed, a step got no answer in time, the instance id changed, or the executor forgot
our session: its caches are gone or unknowable, so every running request is requeued to be recomputed
(policy.executor_lost: outputs kept, nothing fails), health turns NOT_SERVING, and a task polls GetInfo.
New requests are still queued while the retry window (cfg.executor_retry_s, from the loss) lasts; past it
every queued request ends UNAVAILABLE and new ones fail at once until an executor serves again.

Back — an executor answers GetInfo: it must serve what the scheduler relies on (model, vocabulary, EOS ids,
maximum length: the tokenizer and every queued sequence were built for them; the baseline capabilities,
tandem.capabilities.BASELINE), else the queue fails clearly and polling goes on. If it is the same process (same
instance id), what the lost one may still hold is freed (the old session closed, or without sessions the
forgotten caches released); a new session is opened; the engine adopts the info (token budget, adapter slots;
queued requests whose adapter it lacks end NOT_FOUND; queue clocks restart: the outage does not count against
--max-queue-time); the loop runs again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from scheduler.engine import executor_codec as codec
from scheduler.config import SchedulerConfig
from scheduler.executor.client import ExecutorClient, ExecutorUnreachable
from scheduler.executor.info import ExecutorInfo
from scheduler.engine.policy import SchedulingPolicy
from scheduler.executor.session import ExecutorSession
from scheduler.output.step_outcome import Failure
from tandem.capabilities import BASELINE
from tandem.errors import RemoteError, Unavailable

log = logging.getLogger("tandem.scheduler")


class Recovery:
    def __init__(self, cfg: SchedulerConfig, client: ExecutorClient, session: ExecutorSession,
                 policy: SchedulingPolicy, clock: Callable[[], float], known: Callable[[], ExecutorInfo],
                 adopt: Callable[[ExecutorInfo], None], fail: Callable[[list[Failure]], None],
                 on_health: Callable[[bool], None], closed: Callable[[], bool]) -> None:
        """known: the info the engine's requests were built for; adopt: the engine takes an executor that is
        back (its info); fail: ends these requests' streams; closed: the engine is drained."""
        self.cfg, self.client, self.session, self.policy, self.clock = cfg, client, session, policy, clock
        self._known, self._adopt, self._fail, self._on_health, self._closed = known, adopt, fail, on_health, closed
        self.up = True  # the executor answers, and our session on it is open
        self.losses = 0  # losses so far: a step that answers after one has nothing to apply
        self.refusal = ""  # while down: why new requests fail at once ("" = they are queued)
        self.reason = ""  # while down: why it was lost
        self.unfit = ""  # while down: why the executor that answers cannot be used (another model...)
        self._down_since = 0.0
        self._lost_session = ""  # the lost executor's session: closed if that same process answers again
        self._task: asyncio.Task | None = None

    def lost(self, reason: str) -> None:
        if not self.up:
            return
        requeued = self.policy.executor_lost()
        self.up = False
        self.reason = reason
        self.losses += 1
        self._down_since = self.clock()
        self.refusal = ""
        self._lost_session = self.session.forget()
        log.error("%s; %d running and %d queued requests wait up to %g s (--executor-retry-s) for it to serve "
                  "again, then are recomputed", reason, requeued, len(self.policy.waiting) - requeued,
                  self.cfg.executor_retry_s)
        self._on_health(False)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._reconnect(), name="reconnect")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _check_retry_window(self) -> None:
        if self.refusal or self.clock() - self._down_since < self.cfg.executor_retry_s:
            return
        self.refusal = (f"executor {self.client.address} did not serve again within {self.cfg.executor_retry_s:g} "
                        "s (--executor-retry-s); the scheduler serves again once it is back")
        failed = self.policy.fail_all(ExecutorUnreachable(self.refusal))
        log.error("%s: %d requests end UNAVAILABLE", self.refusal, len(failed))
        self._fail(failed)

    async def _reconnect(self) -> None:
        first = True
        while not self._closed():
            if not first:
                wait = self.cfg.reconnect_interval_s
                if not self.refusal:  # wake at the end of the window, not up to an interval later
                    wait = min(wait, max(0.0, self._down_since + self.cfg.executor_retry_s - self.clock()))
                await asyncio.sleep(wait)
            first = False
            self._check_retry_window()
            try:
                info = codec.executor_info_from_pb(await self.client.info())
            except (ExecutorUnreachable, RemoteError):
                continue
            if await self._back(info):
                return

    async def _back(self, info: ExecutorInfo) -> bool:
        """False: the executor that answers cannot be used (yet); keep polling."""
        known = self._known()
        unfit = unfit_reason(known, info, self.client.address)
        if unfit:
            if unfit != self.refusal:
                log.error("%s", unfit)
            self.refusal = self.unfit = unfit
            self._fail(self.policy.fail_all(Unavailable(unfit)))
            return False
        stale = self.policy.releases.take_stale()
        same_process = info.instance_id == known.instance_id  # "" == "": unknown, so it may be
        try:
            if same_process and self._lost_session:
                await self.client.close_session(self._lost_session)  # frees every cache the old session held
            elif same_process and stale:
                await self.client.release(stale)  # unknown ids are no error
            self._lost_session = ""
            await self.session.open(info.session_ttl_ms)
        except (ExecutorUnreachable, RemoteError) as exc:
            self.policy.releases.keep_stale(stale)
            log.warning("executor %s answers but cannot be used yet: %s", self.client.address, exc)
            return False
        self._adopt(info)
        self.up, self.refusal, self.reason, self.unfit = True, "", "", ""
        self._on_health(True)
        log.info("executor %s serves again (%d KV blocks free, session %s); %d requests to recompute or run",
                 self.client.address, self.policy.kv.free_blocks, self.session.id or "(none)",
                 len(self.policy.waiting))
        return True


def unfit_reason(was: ExecutorInfo, now: ExecutorInfo, address: str) -> str:
    """Why an executor that answers again (or joins the fleet: `was` is then the fleet's reference) cannot continue
    the scheduler's requests ("" = it can): another model, or older than the capabilities' baseline."""
    for what, old, new in (("model", was.model_id, now.model_id), ("model directory", was.model_dir, now.model_dir),
                           ("vocabulary size", was.vocab_size, now.vocab_size),
                           ("EOS token ids", list(was.eos_token_ids), list(now.eos_token_ids)),
                           ("maximum sequence length", was.max_seq_len, now.max_seq_len)):
        if old != new:
            shown = "" if what == "model directory" else f" ({new} instead of {old})"  # no host paths
            return f"executor {address} came back with another {what}{shown}; restart the scheduler to serve it"
    missing = sorted(BASELINE - now.capabilities)
    if missing:  # (what the scheduler relies on without checking: an executor from before capabilities existed)
        return (f"executor {address} lacks the capabilities {missing}, which this scheduler relies on: it is older "
                "than the contract's baseline (docs/executor-contract.md#versions); upgrade it")
    return ""
