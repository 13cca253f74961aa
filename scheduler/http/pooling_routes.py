"""The embedding and scoring routes of the OpenAI-compatible front: POST /v1/embeddings (OpenAI's), /v1/score
(vLLM's) and /v1/rerank (Cohere's and Jina's shape, as vLLM serves it). Each makes the moves the completion
routes make: body (pooling_schemas.py) -> pooled requests, tokenized in the worker threads
(scheduler/pooling/inputs.py, scoring.py) -> the fleet, --max-running of a request's inputs at a time, batched
with generations (scheduler/pooling/runner.py) -> JSON. Status codes come from errors.py; the bearer-token
scopes are the other routes' (auth.py: a user token)."""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol, Sequence, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from scheduler.fleet.fleet import Fleet
from scheduler.http import pooling_schemas as ps
from scheduler.pooling.inputs import FieldError, embed_prompts, embed_spec, pooled_request, pooling_facts, request_id
from scheduler.pooling.runner import ClientGone, PooledResult, run_pooled
from scheduler.pooling.scoring import check_count, pair_prompts, scorer
from scheduler.pooling.vectors import check_dimensions, encoded, shaped
from scheduler.request import GenerateRequest
from scheduler.token_limits import TokenLimits, cost
from tandem.security.auth import CURRENT_PRINCIPAL

T = TypeVar("T")


class Front(Protocol):
    """What the routes use of the app's shared state (app.py's _Front)."""

    fleet: Fleet
    workers: Executor | None
    limits: TokenLimits

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def adapter_for(self, model: str | None) -> str: ...

    def names(self) -> tuple[str, ...]: ...


def add_pooling_routes(app: FastAPI, front: Front) -> None:
    fleet = front.fleet
    cfg = fleet.cfg.pooling

    async def run(requests: list[GenerateRequest], request: Request,
                  first_alone: bool = False) -> list[PooledResult] | None:
        """The requests' values in order, under the caller's token share; None when the client went away.
        first_alone: they share a prefix (runner.py)."""
        with front.limits.enter(CURRENT_PRINCIPAL.get()) as lease:
            lease.charge(cost(requests))
            try:
                return await run_pooled(fleet, requests, fleet.cfg.max_running, request.receive, first_alone)
            except ClientGone:
                return None

    @app.post("/v1/embeddings")
    async def embeddings(body: ps.EmbeddingRequest, request: Request) -> Response:
        adapter = await front.adapter_for(body.model)
        info, model = fleet.info, adapter or front.names()[0]
        spec = embed_spec(info)
        check_dimensions(body.dimensions, pooling_facts(info), info.hidden_size, model)
        given = body.input
        inputs = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
        prompts = await front.off_loop(embed_prompts, inputs, fleet.tokenizer, info, cfg.max_inputs,
                                       fleet.cfg.max_prompt_chars)
        rid = request_id("embd-")
        results = await run([pooled_request(f"{rid}-{i}", p, spec, adapter) for i, p in enumerate(prompts)], request)
        if results is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        fmt = body.encoding_format or "float"
        data = [ps.EmbeddingData(embedding=encoded(shaped(r.values, body.dimensions), fmt), index=i)
                for i, r in enumerate(results)]
        tokens = sum(r.prompt_tokens for r in results)
        return _json(ps.EmbeddingResponse(data=data, model=model, usage=ps.EmbeddingUsage(prompt_tokens=tokens,
                                                                                            total_tokens=tokens)))

    async def scores(model: str | None, queries: Sequence[str], documents: Sequence[str], query_param: str,
                     document_param: str, request: Request) -> tuple[str, list[float], int] | None:
        """(model name, one score per pair, prompt tokens); None when the client went away."""
        adapter = await front.adapter_for(model)
        s = scorer(fleet.info, fleet.tokenizer, cfg)
        prompts = await front.off_loop(pair_prompts, s, fleet.tokenizer, fleet.info, queries, documents,
                                       query_param, document_param)
        rid = request_id("score-")
        results = await run([pooled_request(f"{rid}-{i}", p, s.spec, adapter) for i, p in enumerate(prompts)],
                            request, first_alone=len(set(queries)) == 1)  # (one query: its prompt is shared)
        if results is None:
            return None
        return adapter or front.names()[0], [s.score(r.values) for r in results], sum(r.prompt_tokens for r in results)

    @app.post("/v1/score")
    async def score(body: ps.ScoreRequest, request: Request) -> Response:
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        check_count(len(second), cfg, "text_2")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise FieldError("text_1", f"has {len(first)} texts and text_2 {len(second)}: give one text_1 for every "
                             "text_2, or a single one for all")
        got = await scores(body.model, first, second, "text_1", "text_2", request)
        if got is None:
            return Response(status_code=499)
        model, values, tokens = got
        return _json(ps.ScoreResponse(id=request_id("score-"), created=int(time.time()), model=model,
                                      data=[ps.ScoreData(index=i, score=v) for i, v in enumerate(values)],
                                      usage=ps.ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)))

    @app.post("/v1/rerank")
    async def rerank(body: ps.RerankRequest, request: Request) -> Response:
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        check_count(len(texts), cfg, "documents")
        got = await scores(body.model, [body.query] * len(texts), texts, "query", "documents", request)
        if got is None:
            return Response(status_code=499)
        model, values, tokens = got
        order = sorted(range(len(values)), key=lambda i: -values[i])[:body.top_n or None]
        keep = body.return_documents is not False
        results = [ps.RerankResult(index=i, relevance_score=values[i],
                                   document=ps.RerankDocumentOut(text=texts[i]) if keep else None) for i in order]
        payload = ps.RerankResponse(id=request_id("rerank-"), model=model, results=results,
                                    usage=ps.ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))
        return Response(payload.model_dump_json(exclude_none=True), media_type="application/json")


def _json(payload: ps.Out) -> Response:
    return Response(payload.model_dump_json(), media_type="application/json")
