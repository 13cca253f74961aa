"""GenerateService over gRPC (asyncio): proto -> domain -> one fleet call -> proto. Status codes come from
the interceptor (scheduler/rpc/interceptor.py); nothing here picks one.

Inputs are size-checked on the event loop (lengths only), then tokenized and chat-templated in a worker
thread, so a large request never stalls the other streams."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import Executor
from typing import AsyncIterator, Callable, TypeVar

from tandem.errors import TandemError
from tandem.generate.v1 import generate_pb2 as pb
from tandem.generate.v1 import generate_pb2_grpc as pb_grpc
from scheduler.rpc import codec
from scheduler.rpc.embed_codec import embed_inputs_from_pb, embed_response_to_pb
from scheduler.fleet.fleet import Fleet
from scheduler.pooling.inputs import embed_prompts, embed_spec, pooled_request, pooling_facts, request_id
from scheduler.pooling.runner import run_pooled
from scheduler.pooling.vectors import check_dimensions, shaped
from scheduler.token_limits import TokenLimits, cost
from tandem.security.auth import CURRENT_PRINCIPAL

T = TypeVar("T")


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    def __init__(self, fleet: Fleet, workers: Executor | None = None, limits: TokenLimits | None = None) -> None:
        self.fleet = fleet
        self._workers = workers  # None: the event loop's default thread pool
        self._limits = limits or TokenLimits()  # per-token shares (the caller: CURRENT_PRINCIPAL, set by auth)

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        fleet = self.fleet
        received = time.monotonic()  # (the queue bound counts from here: tokenizing is part of the wait)
        fleet.check_overload()  # (before tokenizing: a flood is refused at once)
        with self._limits.enter(CURRENT_PRINCIPAL.get()) as lease:
            codec.check_input_size(request, fleet.cfg.max_prompt_chars)
            if request.adapter and request.adapter not in fleet.info.adapters:
                await fleet.refresh_info()  # adapters can be loaded at run time: look again before NOT_FOUND
            req = await self._off_loop(codec.request_from_pb, request, fleet.tokenizer, fleet.info,
                                       fleet.cfg.default_max_new_tokens, fleet.grammars, None, fleet.images)
            req = dataclasses.replace(req, received_at=received)
            lease.charge(cost([req]))
            seq, stream = fleet.submit(req)
            try:
                while True:
                    event = await stream.events.get()
                    if isinstance(event, TandemError):
                        raise event
                    if event.finish_reason is not None:
                        lease.release()  # done: the client may start its next request once it reads this
                    yield codec.delta_to_pb(req.request_id, event)
                    if event.finish_reason is not None:
                        return
            finally:
                fleet.abort(seq)  # a no-op for a finished sequence; frees the cache of a cancelled one

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tok = self.fleet.tokenizer
        codec.check_input_size(request, self.fleet.cfg.max_prompt_chars)

        def tokenize() -> pb.TokenizeResponse:
            ids = codec.prompt_ids_from_pb(request, tok, self.fleet.info.vocab_size)
            return pb.TokenizeResponse(token_ids=ids, pieces=tok.pieces(ids))

        return await self._off_loop(tokenize)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        fleet = self.fleet
        await fleet.refresh_info()  # adapters may have been loaded or unloaded on the executor since
        return codec.model_info_to_pb(fleet.info, fleet.tokenizer, fleet.max_batch_tokens, fleet.cfg, fleet.stats())

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        fleet, info = self.fleet, self.fleet.info
        spec = embed_spec(info)
        dims = request.dimensions if request.HasField("dimensions") else None
        check_dimensions(dims, pooling_facts(info), info.hidden_size, info.model_id)
        prompts = await self._off_loop(embed_prompts, embed_inputs_from_pb(request), fleet.tokenizer, info,
                                       fleet.cfg.pooling.max_inputs, fleet.cfg.max_prompt_chars, "inputs")
        rid = request.request_id or request_id()
        reqs = [pooled_request(f"{rid}-{i}", p, spec) for i, p in enumerate(prompts)]
        with self._limits.enter(CURRENT_PRINCIPAL.get()) as lease:
            lease.charge(cost(reqs))
            results = await run_pooled(fleet, reqs, fleet.cfg.max_running)
        return embed_response_to_pb(rid, [shaped(r.values, dims) for r in results],
                                    [r.prompt_tokens for r in results])

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)
