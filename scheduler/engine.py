"""The continuous-batching loop: one UnifiedDecode per step, results streamed to each request.

Everything runs on the server's asyncio loop (no locks): gRPC handlers submit and abort sequences, the
loop task plans a step (scheduler/planner.py), awaits the executor, appends the sampled tokens, streams
deltas and releases the caches of finished, cancelled and preempted sequences.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from typing import Callable

from tandem.codec import kv_usage_from_pb, sampling_to_pb
from tandem.errors import CapacityExceeded, RemoteError, TandemError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb
from scheduler.codec import with_banned_tokens
from scheduler.config import SchedulerConfig
from scheduler.executor_client import ExecutorUnreachable, GrpcExecutorClient
from scheduler.planner import Planner, StepItem
from scheduler.request import GenerateRequest, TokenLogprob
from scheduler.sequence import Sequence, Status

log = logging.getLogger("tandem.scheduler")
_STALL_POLL_S = 0.05  # KV held by another client of the executor: how often to look again
_STATS_EVERY_S = 10.0


class Engine:
    def __init__(self, cfg: SchedulerConfig, client: GrpcExecutorClient, tokenizer,
                 info: epb.GetInfoResponse, on_health: Callable[[bool], None] = lambda up: None) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        budget = min(cfg.max_batch_tokens, info.max_batch_tokens or cfg.max_batch_tokens)
        self.planner = Planner(budget, cfg.max_running, cfg.prefill_chunk)
        self.kv = kv_usage_from_pb(info.kv)
        self.running: list[Sequence] = []  # admitted, oldest arrival first
        self.waiting: list[Sequence] = []  # new or preempted, oldest arrival first
        self.up = True  # the executor answers
        self.steps = 0
        self.preemptions = 0
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._to_release: list[str] = []
        self._in_flight: set[Sequence] = set()
        self._stopping = False
        self._closed = False
        self._on_health = on_health
        self._exec_output: dict[int, epb.OutputOptions] = {}
        self._stats = (time.monotonic(), 0)

    # ----------------------------------------------------------------- requests (called by the servicer)
    def submit(self, request: GenerateRequest) -> Sequence:
        if self._stopping:
            raise Unavailable("the scheduler is shutting down; retry on another one")
        if not self.up:
            raise ExecutorUnreachable(f"executor {self.client.address} is unreachable; the scheduler reconnects "
                                      "and serves again when it is back")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise CapacityExceeded(f"the scheduler's queue is full ({self.cfg.max_waiting} requests waiting); "
                                   "retry later")
        tokens = len(request.prompt_ids) + request.stopping.max_new_tokens
        if not Planner.fits_alone(tokens, self.kv):
            raise CapacityExceeded(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.stopping.max_new_tokens}) "
                f"need {self.kv.blocks_for(tokens)} KV blocks but the executor's whole cache has "
                f"{self.kv.total_blocks} (x {self.kv.block_size} tokens); shorten the request")
        seq = Sequence(request, next(self._arrivals), self.tokenizer, self.info.eos_token_ids, self.info.max_seq_len)
        sampling = sampling_to_pb(request.sampling)
        stop = request.stopping
        early = (with_banned_tokens(sampling, set(seq.eos_token_ids) | stop.stop_token_ids)
                 if stop.min_new_tokens else sampling)
        seq.executor_sampling = (sampling, early)
        self.waiting.append(seq)  # arrivals increase: appending keeps the order
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """The client went away (cancel, deadline): drop the sequence and free its cache at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq not in self._in_flight and seq.cache_id:
            self._to_release.append(seq.cache_id)  # in flight: released when the step returns
            seq.cache_id = ""
        if not seq.finished:
            log.info("request %s cancelled by the client after %d tokens", seq.request.request_id,
                     len(seq.output_ids))
        seq.status = Status.FINISHED
        self._wake.set()

    async def refresh_info(self) -> None:
        """Re-reads the executor's info (adapters loaded since, KV)."""
        try:
            self.info = await self.client.info()
            self.kv = kv_usage_from_pb(self.info.kv)
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
            if not (self.running or self.waiting):
                self._wake.clear()
                if not self._to_release:
                    await self._wake.wait()
                continue
            await self._step()

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests, lets running ones finish for up to grace_s, aborts the rest."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while (self.running or self.waiting) and time.monotonic() < deadline and self.up:
            await asyncio.sleep(0.05)
        for seq in self.running + self.waiting:
            seq.abort()
            if seq.cache_id:
                self._to_release.append(seq.cache_id)
        self.running.clear()
        self.waiting.clear()
        while self._in_flight:  # the step in progress must return before its caches can be released
            await asyncio.sleep(0.01)
        await self._release_pending()
        self._closed = True
        self._wake.set()

    async def _step(self) -> None:
        plan = self.planner.plan(self.running, self.waiting, self.kv)
        for victim in plan.preempted:
            self._preempt(victim)
        for seq in plan.admitted:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            _insort(self.running, seq)
        if plan.preempted:
            await self._release_pending()  # the plan counts on the victims' blocks being free
            if not self.up:
                return
        if not plan.items:
            await self._stalled()
            return
        self._in_flight = {item.seq for item in plan.items}
        try:
            resp = await self.client.unified_decode([self._item_pb(item) for item in plan.items])
        except ExecutorUnreachable as exc:
            self._executor_lost(exc)
            return
        except RemoteError as exc:
            if exc.status_name == "RESOURCE_EXHAUSTED":  # someone else took blocks: make room, plan again
                await self.refresh_info()
                if self.running:
                    self._preempt(self.running[-1])
                else:
                    await asyncio.sleep(_STALL_POLL_S)
                return
            self._fail_batch(plan.items, exc)
            return
        finally:
            self._in_flight = set()
        self.steps += 1
        self.kv = kv_usage_from_pb(resp.kv)
        for item, res in zip(plan.items, resp.results):
            self._apply(item.seq, res)
        self._log_stats(sum(item.count for item in plan.items))

    def _apply(self, seq: Sequence, res: epb.UnifiedResult) -> None:
        seq.cache_id, seq.num_cached = res.cache.cache_id, res.cache.seq_len
        if seq.status is Status.FINISHED:  # aborted while the step ran
            self._to_release.append(seq.cache_id)
            seq.cache_id = ""
            return
        if res.HasField("output") and res.output.tokens:
            t = res.output.tokens[0]
            seq.append(TokenLogprob(t.token_id, t.logprob, tuple((a.token_id, a.logprob) for a in t.top_logprobs)))
            seq.publish()
        if seq.finished:
            self.running.remove(seq)
            self._to_release.append(seq.cache_id)
            seq.cache_id = ""

    def _item_pb(self, item: StepItem) -> epb.UnifiedItem:
        seq, req = item.seq, item.seq.request
        return epb.UnifiedItem(cache_id=seq.cache_id, token_ids=seq.token_slice(item.start, item.start + item.count),
                               pos_offset=item.start, is_final_chunk=item.is_final, sampling=seq.sampling_for_next_token(),
                               output=self._output_options(req.top_logprobs), adapter=req.adapter,
                               # read by the executor at the first final chunk only
                               prompt_len=len(req.prompt_ids) if item.is_final else None)

    def _output_options(self, top_logprobs: int) -> epb.OutputOptions:
        opts = self._exec_output.get(top_logprobs)
        if opts is None:
            opts = self._exec_output[top_logprobs] = epb.OutputOptions(mode=epb.OUTPUT_MODE_TOKENS,
                                                                       top_logprobs=top_logprobs)
        return opts

    # ----------------------------------------------------------------- capacity
    def _preempt(self, seq: Sequence) -> None:
        """Releases seq's cache and requeues it; it is recomputed (prompt + outputs so far) when admitted."""
        self.running.remove(seq)
        if seq.cache_id:
            self._to_release.append(seq.cache_id)
        seq.reset_cache()
        _insort(self.waiting, seq)
        self.preemptions += 1
        log.info("preempted request %s (%d tokens) to free KV blocks; it will be recomputed",
                 seq.request.request_id, seq.num_tokens)

    async def _stalled(self) -> None:
        """No item fits this step. Preempt if our own sequences hold the blocks; fail a request that cannot
        fit even an empty cache; otherwise the blocks are held elsewhere: look again shortly."""
        if self.running:
            self._preempt(self.running[-1])
            return
        await self._release_pending()
        await self.refresh_info()
        head = self.waiting[0] if self.waiting else None
        if head is not None and not Planner.fits_alone(head.num_tokens + 1, self.kv):
            self.waiting.remove(head)
            head.fail(CapacityExceeded(f"request {head.request.request_id} ({head.num_tokens} tokens) does not fit "
                                       f"the executor's KV cache ({self.kv.total_blocks} blocks of "
                                       f"{self.kv.block_size} tokens)"))
            return
        await asyncio.sleep(_STALL_POLL_S)

    async def _release_pending(self) -> None:
        if not self._to_release or not self.up:
            return
        ids, self._to_release = self._to_release, []
        try:
            resp = await self.client.release(ids)
            self.kv = kv_usage_from_pb(resp.kv)
        except ExecutorUnreachable as exc:
            self._to_release.extend(ids)  # retried after reconnecting (unknown ids are no error)
            self._executor_lost(exc)
        except RemoteError as exc:
            log.error("ReleaseCache of %d caches failed: %s", len(ids), exc)

    # ----------------------------------------------------------------- failures
    def _fail_batch(self, items: list[StepItem], exc: TandemError) -> None:
        """The executor rejected the step (a bug or a race, e.g. an adapter unloaded): the step's requests end
        with its status; their caches are released."""
        log.error("UnifiedDecode failed for %d requests: %s", len(items), exc)
        for item in items:
            seq = item.seq
            if seq in self.running:
                self.running.remove(seq)
            if seq.cache_id:
                self._to_release.append(seq.cache_id)
                seq.cache_id = ""
            seq.fail(exc)

    def _executor_lost(self, exc: Unavailable) -> None:
        if not self.up:
            return
        log.error("%s; failing %d in-flight requests", exc, len(self.running) + len(self.waiting))
        self.up = False
        self._on_health(False)
        for seq in self.running + self.waiting:
            if seq.cache_id:
                self._to_release.append(seq.cache_id)
            seq.fail(exc)
        self.running.clear()
        self.waiting.clear()
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
            self.info, self.kv, self.up = info, kv_usage_from_pb(info.kv), True
            self._on_health(True)
            log.info("executor %s is back (%d KV blocks free); serving again", self.client.address,
                     self.kv.free_blocks)
            self._wake.set()
            return

    def _log_stats(self, tokens: int) -> None:
        since, count = self._stats
        count += tokens
        now = time.monotonic()
        if now - since >= _STATS_EVERY_S:
            used = 1 - self.kv.free_blocks / max(1, self.kv.total_blocks)
            log.info("%d running, %d waiting, KV %.0f%% used, %.1f tokens/s through the model, %d preemptions",
                     len(self.running), len(self.waiting), 100 * used, count / (now - since), self.preemptions)
            since, count = now, 0
        self._stats = (since, count)


def _insort(seqs: list[Sequence], seq: Sequence) -> None:
    bisect.insort(seqs, seq, key=lambda s: s.arrival)
