"""vLLM's engine protocol `vllm.grpc.engine.VllmEngine` (the one SGLang's gateway smg routes to over gRPC),
served beside GenerateService on the scheduler's port: proto -> GenerateService's request
(scheduler/compat/vllm_engine_codec.py) -> the same fleet calls as GenerateServicer -> proto. Status codes come from the
interceptor (scheduler/rpc/interceptor.py); nothing here picks one.

smg tokenizes in the router and sends token ids; we stream token ids and logprobs back, and smg detokenizes.
A request's choices (n) are requests of their own on the fleet, merged into one stream by their index. A
client that goes away, or an Abort naming the request id, frees its sequences (fleet.abort)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from concurrent.futures import Executor
from pathlib import Path
from typing import AsyncIterator, Callable, TypeVar

from scheduler.rpc import codec

from scheduler.text import tokenizer_bundle
from scheduler.compat import vllm_engine_codec as vcodec
from scheduler.fleet.fleet import Fleet
from scheduler.pooling.inputs import embed_prompts, embed_spec, pooled_request, request_id
from scheduler.pooling.runner import run_pooled
from scheduler.request import Delta
from scheduler.output.request_stream import RequestStream
from scheduler.sequence import Sequence
from scheduler.token_limits import TokenLimits, cost
from tandem.errors import NotServed, TandemError
from tandem.security.auth import CURRENT_PRINCIPAL
from tandem.vendor.smg import common_pb2 as smg_common
from tandem.vendor.smg import vllm_engine_pb2 as vpb
from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc

T = TypeVar("T")
SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
VERSION = "tandem-0.1.0"  # GetLoads.version (vLLM's version there)


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, fleet: Fleet, workers: Executor | None = None, limits: TokenLimits | None = None,
                 served_name: str = "", chat_template: str | None = None,
                 healthy: Callable[[], bool] | None = None) -> None:
        """served_name: the model's name to routers (--served-model-name, else the executor's model id).
        chat_template: the scheduler's --chat-template, handed to routers with the tokenizer files.
        healthy: whether to take requests now (default: while some executor serves; the server adds its drain)."""
        self.fleet = fleet
        self._healthy = healthy or (lambda: fleet.up)
        self._workers = workers
        self._limits = limits or TokenLimits()
        self._served_name = served_name or fleet.info.model_id
        self._chat_template = chat_template
        self._started = time.time()
        self._last_receive = 0.0
        # request id -> the streams of its choices still running (an id may be reused by concurrent calls)
        self._running: defaultdict[str, list[tuple[Sequence, RequestStream]]] = defaultdict(list)
        self._bundle: tokenizer_bundle.Bundle | None = None

    async def Generate(self, request: vpb.GenerateRequest, context) -> AsyncIterator[vpb.GenerateResponse]:
        self._last_receive = time.time()
        fleet = self.fleet
        vcodec.check_supported(request)
        m = vcodec.generate_request_to_pb(request)
        n = vcodec.choices_of(request)
        received = time.monotonic()  # (the queue bound counts from here: tokenizing is part of the wait)
        fleet.check_overload()  # (before tokenizing: a flood is refused at once)
        with self._limits.enter(CURRENT_PRINCIPAL.get(), n) as lease:
            codec.check_input_size(m, fleet.cfg.max_prompt_chars)
            req = await self._off_loop(codec.request_from_pb, m, fleet.tokenizer, fleet.info,
                                       fleet.cfg.default_max_new_tokens, fleet.grammars)
            req = dataclasses.replace(req, received_at=received)
            reqs = [req] if n == 1 else req.choices(n)  # (one choice keeps the router's id)
            lease.charge(cost(reqs))
            submitted = []
            try:
                for r in reqs:
                    submitted.append(fleet.submit(r))
                self._running[request.request_id] += submitted
                asked = request.sampling_params
                answers = [vcodec.Answer(i, req.prompt_ids, asked.logprobs if asked.HasField("logprobs") else None,
                                         request.stream, req.prompt_logprobs) for i in range(n)]
                left = n
                async for index, event in _merged([stream for _, stream in submitted]):
                    if isinstance(event, TandemError):
                        raise event
                    if event.finish_reason is not None:
                        left -= 1
                        if not left:
                            lease.release()  # done: the client may start its next request once it reads this
                    for message in answers[index].messages(event, submitted[index][1].cached_tokens):
                        yield message
                    if not left:
                        return
            finally:
                for seq, stream in submitted:
                    fleet.abort(seq)  # a no-op for a finished sequence; frees the cache of a cancelled one
                    self._forget(request.request_id, seq)

    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        """Ends the named requests' streams (their Generate calls answer finish_reason "abort") and frees their
        caches. Ids this scheduler does not run are ignored, as vLLM does (a request may have just ended)."""
        for request_id in request.request_ids:
            for seq, stream in self._running.pop(request_id, []):
                stream.abort(seq.preemptions)  # the reader sees the end; nothing more is queued for it
                self.fleet.abort(seq)
        return vpb.AbortResponse()

    async def HealthCheck(self, request: vpb.HealthCheckRequest, context) -> vpb.HealthCheckResponse:
        if self._healthy():
            return vpb.HealthCheckResponse(healthy=True, message="serving")
        why = "no executor serves" if not self.fleet.up else "the scheduler is shutting down"
        return vpb.HealthCheckResponse(healthy=False, message=why)

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest, context) -> vpb.GetModelInfoResponse:
        return vcodec.model_info_to_pb(self.fleet.info, self._served_name)

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest, context) -> vpb.GetServerInfoResponse:
        return vcodec.server_info_to_pb(self.fleet.info, self.fleet.stats(), time.time() - self._started,
                                        self._last_receive)

    async def GetLoads(self, request: vpb.GetLoadsRequest, context) -> vpb.GetLoadsResponse:
        # dp_rank and include filter nothing: the scheduler is one rank with core metrics only (as vLLM's)
        return vcodec.loads_to_pb(self.fleet.stats(), self.fleet.cfg.max_running, VERSION)

    async def GetTokenizer(self, request: smg_common.GetTokenizerRequest,
                           context) -> AsyncIterator[smg_common.GetTokenizerChunk]:
        if self._bundle is None:  # the files do not change under a running scheduler: built once
            self._bundle = await self._off_loop(tokenizer_bundle.build, Path(self.fleet.tokenizer.model_dir),
                                                self._chat_template)
        chunks = self._bundle.chunks()
        for i, data in enumerate(chunks):
            yield smg_common.GetTokenizerChunk(data=data, sha256=self._bundle.sha256 if i == len(chunks) - 1 else "")

    async def Embed(self, request: vpb.EmbedRequest, context) -> vpb.EmbedResponse:
        """One input's embedding (smg tokenizes: input_ids are used as given), pooled and normalised as
        GenerateService.Embed's (scheduler/pooling/)."""
        self._last_receive = time.time()
        fleet, info = self.fleet, self.fleet.info
        spec = embed_spec(info)
        (ids,) = embed_prompts([list(request.tokenized.input_ids)], fleet.tokenizer, info, 1,
                               fleet.cfg.max_prompt_chars, "tokenized.input_ids")
        req = pooled_request(request.request_id or request_id(), ids, spec)
        with self._limits.enter(CURRENT_PRINCIPAL.get()) as lease:
            lease.charge(cost([req]))
            (result,) = await run_pooled(fleet, [req], 1)
        return vpb.EmbedResponse(embedding=result.values, prompt_tokens=result.prompt_tokens,
                                 embedding_dim=len(result.values))

    async def FlushCache(self, request: smg_common.FlushCacheRequest, context) -> smg_common.FlushCacheResponse:
        raise NotServed("FlushCache: Tandem's executors keep their prefix caches (blocks are evicted as needed, "
                        "and a restarted executor starts empty); there is no flush")

    async def SubscribeKvEvents(self, request: smg_common.SubscribeKvEventsRequest,
                                context) -> AsyncIterator[smg_common.KvEventBatch]:
        raise NotServed("SubscribeKvEvents: the scheduler relays no KV events over gRPC; each executor publishes "
                        "them in vLLM's ZMQ format (--kv-events-endpoint)")
        yield  # (an async generator, as the stream's handler must be)

    def _forget(self, request_id: str, seq: Sequence) -> None:
        running = self._running.get(request_id)
        if running is not None:
            running[:] = [(s, st) for s, st in running if s is not seq]
            if not running:
                del self._running[request_id]

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta | TandemError]]:
    """Every stream's events as they come, with the stream's index; each stream ends at its last delta (or
    error). One stream is read directly; several through one queue their pumps fill."""
    if len(streams) == 1:
        while True:
            event = await streams[0].events.get()
            yield 0, event
            if isinstance(event, TandemError) or event.finish_reason is not None:
                return
    queue: asyncio.Queue[tuple[int, Delta | TandemError]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        while True:
            event = await stream.events.get()
            queue.put_nowait((index, event))
            if isinstance(event, TandemError) or event.finish_reason is not None:
                return

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    ended = 0
    try:
        while ended < len(streams):
            index, event = await queue.get()
            yield index, event
            if isinstance(event, TandemError) or event.finish_reason is not None:
                ended += 1
    finally:
        for p in pumps:
            p.cancel()
