"""The continuous-batching loop: moves data between the scheduling policy (scheduler/policy.py, synchronous),
the executor client (scheduler/executor_client.py) and each request's output stream.

Everything runs on the server's asyncio loop (no locks): gRPC handlers submit and abort requests; the loop
task asks the policy for a step, awaits the executor, hands the step's results back to the policy, streams
the deltas and releases the caches the policy retired.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from scheduler import codec
from scheduler.config import SchedulerConfig
from scheduler.executor_client import ExecutorClient, ExecutorUnreachable
from scheduler.policy import SchedulingPolicy
from scheduler.request import GenerateRequest
from scheduler.request_output import RequestOutput
from scheduler.sequence import Sequence
from tandem.codec import kv_usage_from_pb
from tandem.errors import CapacityExceeded, RemoteError, TandemError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb

log = logging.getLogger("tandem.scheduler")
_STALL_POLL_S = 0.05  # KV held by another client of the executor: how often to look again
_STATS_EVERY_S = 10.0


class Engine:
    def __init__(self, cfg: SchedulerConfig, client: ExecutorClient, tokenizer,
                 info: epb.GetInfoResponse, on_health: Callable[[bool], None] = lambda up: None) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        self.policy = SchedulingPolicy(cfg, kv_usage_from_pb(info.kv), info.max_batch_tokens)
        self.planner = self.policy.planner
        self.outputs: dict[Sequence, RequestOutput] = {}
        self.up = True  # the executor answers
        self.steps = 0
        self._wake = asyncio.Event()
        self._stepping = False
        self._stopping = False
        self._closed = False
        self._on_health = on_health
        self._stats = (time.monotonic(), 0)

    # ----------------------------------------------------------------- requests (called by the servicer)
    def submit(self, request: GenerateRequest) -> tuple[Sequence, RequestOutput]:
        if self._stopping:
            raise Unavailable("the scheduler is shutting down; retry on another one")
        if not self.up:
            raise ExecutorUnreachable(f"executor {self.client.address} is unreachable; the scheduler reconnects "
                                      "and serves again when it is back")
        self.policy.check_admissible(len(request.prompt_ids), request.stopping.max_new_tokens)
        seq = Sequence(request, self.policy.next_arrival(), self.info.eos_token_ids, self.info.max_seq_len,
                       codec.executor_sampling(request, self.info.eos_token_ids))
        output = RequestOutput(request, self.tokenizer)
        self.outputs[seq] = output
        self.policy.add(seq)
        self._wake.set()
        return seq, output

    def abort(self, seq: Sequence) -> None:
        """The client went away (cancel, deadline) or its stream ended: drop the sequence, free its cache."""
        output = self.outputs.pop(seq, None)
        if output is not None and not output.finished:
            log.info("a request was cancelled by the client after %d tokens", len(seq.output_ids))
        self.policy.abort(seq)
        self._wake.set()

    async def refresh_info(self) -> None:
        """Re-reads the executor's info (adapters loaded since, KV)."""
        try:
            self.info = await self.client.info()
            self.policy.kv = kv_usage_from_pb(self.info.kv)
        except ExecutorUnreachable as exc:
            self._executor_lost(exc)

    # ----------------------------------------------------------------- the loop
    async def run(self) -> None:
        while not self._closed:
            if not self.up:  # _reconnect() wakes us once the executor is back
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._release_pending()
            if not self.policy.has_work:
                self._wake.clear()
                if not self.policy.has_releases:
                    await self._wake.wait()
                continue
            self._stepping = True
            try:
                await self._step()
            finally:
                self._stepping = False

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests, lets running ones finish for up to grace_s, aborts the rest."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self.policy.has_work and time.monotonic() < deadline and self.up:
            await asyncio.sleep(0.05)
        for seq in self.policy.abort_all():
            output = self.outputs.get(seq)
            if output is not None:
                output.abort(seq.preemptions)
        while self._stepping:  # the step in progress must return before its caches can be released
            await asyncio.sleep(0.01)
        await self._release_pending()
        self._closed = True
        self._wake.set()

    async def _step(self) -> None:
        policy = self.policy
        plan = policy.schedule()
        if plan.preempted:
            await self._release_pending()  # the plan counts on the victims' blocks being free
            if not self.up:
                return
        if not plan.items:
            await self._stalled()
            return
        try:
            resp = await self.client.unified_decode(codec.step_to_pb(plan))
        except ExecutorUnreachable as exc:
            self._executor_lost(exc)
            return
        except RemoteError as exc:
            failed = policy.step_failed(plan, exc, exc.status_name)
            if exc.status_name == "RESOURCE_EXHAUSTED":  # someone else took blocks: make room, plan again
                await self.refresh_info()
                if not policy.running:
                    await asyncio.sleep(_STALL_POLL_S)
            self._fail(failed, exc)
            return
        self.steps += 1
        for e in policy.update(plan, codec.item_results_from_pb(resp), kv_usage_from_pb(resp.kv)):
            output = self.outputs.get(e.seq)
            if output is None:
                continue
            ended = output.add(e.token, e.finish, e.seq.preemptions)
            if ended is not None and e.finish is None:  # a stop string: only the text showed it
                policy.finish(e.seq)
            output.publish()
        self._log_stats(sum(item.count for item in plan.items))

    async def _stalled(self) -> None:
        """No item fits this step. Preempt if our own sequences hold the blocks; fail a request that cannot
        fit even an empty cache; otherwise the blocks are held elsewhere: look again shortly."""
        if self.policy.preempt_for_stall():
            return
        await self._release_pending()
        await self.refresh_info()
        head = self.policy.drop_unfittable_head()
        if head is not None:
            self._fail([head], CapacityExceeded(
                f"request {head.request.request_id} ({head.num_tokens} tokens) does not fit the executor's KV "
                f"cache ({self.policy.kv.total_blocks} blocks of {self.policy.kv.block_size} tokens)"))
            return
        await asyncio.sleep(_STALL_POLL_S)

    async def _release_pending(self) -> None:
        if not self.policy.has_releases or not self.up:
            return
        ids = self.policy.take_releases()
        try:
            resp = await self.client.release(ids)
            self.policy.kv = kv_usage_from_pb(resp.kv)
        except ExecutorUnreachable as exc:
            self.policy.release_failed(ids)  # retried after reconnecting (unknown ids are no error)
            self._executor_lost(exc)
        except RemoteError as exc:
            log.error("ReleaseCache of %d caches failed: %s", len(ids), exc)

    # ----------------------------------------------------------------- failures
    def _fail(self, seqs: list[Sequence], error: TandemError) -> None:
        for seq in seqs:
            output = self.outputs.get(seq)
            if output is not None:
                output.fail(error)

    def _executor_lost(self, exc: Unavailable) -> None:
        if not self.up:
            return
        lost = self.policy.executor_lost()
        log.error("%s; failing %d in-flight requests", exc, len(lost))
        self.up = False
        self._on_health(False)
        self._fail(lost, exc)
        asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.cfg.reconnect_interval_s)
            try:
                info = await self.client.info()
            except ExecutorUnreachable:
                continue
            except RemoteError as exc:
                log.warning("executor answered GetInfo with %s; retrying", exc)
                continue
            if (info.model_dir, info.vocab_size) != (self.info.model_dir, self.info.vocab_size):
                log.error("executor %s came back serving %s (was %s): restart the scheduler to use it",
                          self.client.address, info.model_dir, self.info.model_dir)
                continue
            self.info, self.up = info, True
            self.policy.kv = kv_usage_from_pb(info.kv)
            self._on_health(True)
            log.info("executor %s is back (%d KV blocks free); serving again", self.client.address,
                     self.policy.kv.free_blocks)
            self._wake.set()
            return

    def _log_stats(self, tokens: int) -> None:
        since, count = self._stats
        count += tokens
        now = time.monotonic()
        if now - since >= _STATS_EVERY_S:
            kv = self.policy.kv
            used = 1 - kv.free_blocks / max(1, kv.total_blocks)
            log.info("%d running, %d waiting, KV %.0f%% used, %.1f tokens/s through the model, %d preemptions",
                     len(self.policy.running), len(self.policy.waiting), 100 * used, count / (now - since),
                     self.policy.preemptions)
            since, count = now, 0
        self._stats = (since, count)
