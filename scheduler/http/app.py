"""The OpenAI-compatible routes (FastAPI). A generation handler makes four moves, as the gRPC servicer does:
body -> tandem.generate.v1 GenerateRequest (convert.py) -> the servicer's own size check and
codec.request_from_pb (tokenizing and chat templating in the worker threads) -> fleet.submit (generation.py)
-> OpenAI JSON or SSE chunks (render.py). Status codes come from errors.py; nothing here picks one.

Routes: POST /v1/chat/completions, POST /v1/responses (responses/route.py), POST /v1/completions, GET /v1/models[/{id}], GET /health, POST /tokenize,
POST /detokenize, GET /metrics (only with a metrics hook; 404 otherwise).
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from concurrent.futures import Executor
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from scheduler.rpc import codec
from scheduler.fleet.fleet import Fleet
from scheduler.tool_parsers import registry as tool_parsers
from scheduler.http import convert, errors, reasoning_output, tool_calls
from scheduler.http.responses import route as responses_route
from scheduler.http import response_schemas as s
from scheduler.http.request_schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             StreamOptions, TokenizeRequest)
from scheduler.http.auth import TokenAuth
from scheduler.http.body_limit import BodyLimit
from scheduler.http.cors import Cors
from scheduler.http.errors import BadParameter
from scheduler.http.generation import ClientGone, Generation
from scheduler.http.limits import HttpLimits
from scheduler.http.pooling_routes import add_pooling_routes
from scheduler.http.responses.store import ResponseStore
from scheduler.http.render import DONE, ChatRenderer, CompletionRenderer, TokenTexts, sse
from scheduler.reasoning.parser import ReasoningParser
from scheduler.reasoning.registry import choose as choose_reasoning
from scheduler.request import GenerateRequest
from scheduler.token_limits import Lease, TokenLimits, cost
from tandem.errors import AdapterNotFound, InvalidRequest, Unavailable
from tandem.generate.v1 import generate_pb2 as pb
from tandem.security.auth import CURRENT_PRINCIPAL, Authenticator

T = TypeVar("T")
# /metrics: returns (body, content type), or an awaitable of it (filled in by the metrics exporter)
MetricsHook = Callable[[], tuple[bytes, str] | Awaitable[tuple[bytes, str]]]
_MAX_MODEL_CHARS = 100  # of a `model` quoted back in an error


def _json(payload: s.Out) -> Response:
    return Response(payload.model_dump_json(), media_type="application/json")


class _Front:
    """What the routes share: the fleet, the tokenizer workers, the token text cache, the per-token limits."""

    def __init__(self, fleet: Fleet, workers: Executor | None, limits: TokenLimits, max_prompts: int,
                 reasoning: ReasoningParser | None = None) -> None:
        self.fleet = fleet
        self.reasoning = reasoning  # the parser that splits thinking from answers (--reasoning-parser), or None
        self.workers = workers
        self.limits = limits
        self.max_prompts = max_prompts  # --max-prompts-per-request
        self.texts = TokenTexts(fleet.tokenizer)
        self.created = int(time.time())
        # tool_choice "auto": the syntax read (--tool-call-parser, or the chat template's), chosen once here
        syntax = tool_parsers.choose(fleet.cfg.tool_call_parser, fleet.tokenizer.chat_template)
        tok = fleet.tokenizer
        self.auto_tools = tool_calls.AutoTools(syntax, frozenset(tok.pieces(sorted(tok.special_ids)))) \
            if syntax is not None else None

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    def names(self) -> tuple[str, ...]:
        """The base model's names (--served-model-name; else its directory name): the first is the one
        responses carry."""
        return self.fleet.cfg.served_model_names or (self.fleet.info.model_id,)

    def model_of(self, requests: list[GenerateRequest]) -> str:
        """The `model` a response carries: the requests' adapter's name, or the base model's first name."""
        return (requests[0].adapter if requests else "") or self.names()[0]

    async def adapter_for(self, model: str | None) -> str:
        """`model` -> the adapter to run ("" = the base model): one of the base model's names or "" (or unset)
        is the base model, an adapter's name that adapter; anything else is 404 model_not_found."""
        names = self.names()
        if not model or model in names:
            return ""
        if model not in self.fleet.info.adapters:
            await self.fleet.refresh_info()  # adapters can be loaded at run time: look again before 404
        adapters = list(self.fleet.info.adapters)
        if model in adapters:
            return model
        served = ", ".join(repr(m) for m in [*names, *adapters])
        raise AdapterNotFound(f"the model {model[:_MAX_MODEL_CHARS]!r} does not exist; this server serves {served} "
                              "(GET /v1/models)")

    async def requests(self, messages: list[pb.GenerateRequest], n: int,
                       template_variables: dict | None = None) -> list[GenerateRequest]:
        """Every choice's domain request, validated and tokenized as the gRPC servicer does (each prompt once).
        template_variables: more variables for the chat template (chat_template_kwargs)."""
        fleet = self.fleet
        for m in messages:
            codec.check_input_size(m, fleet.cfg.max_prompt_chars)
        info = fleet.info
        done = await asyncio.gather(*(self.off_loop(codec.request_from_pb, m, fleet.tokenizer, info,
                                                    fleet.cfg.default_max_new_tokens, fleet.grammars,
                                                    template_variables, fleet.images, convert.IMAGE_FIELD)
                                      for m in messages))
        return [choice for r in done for choice in r.choices(n)]

    async def generate(self, choices: int, make_requests: Callable[[], Awaitable[list[GenerateRequest]]],
                       make_renderer: Callable[[list[GenerateRequest]], ChatRenderer | CompletionRenderer],
                       request: Request, stream: bool) -> Response:
        """One completion request of `choices` choices (prompts x n) under the caller's token share: counted
        before tokenizing, charged its tokens after; the share is held until the generation ends
        (Generation.close releases it)."""
        received = time.monotonic()  # (the queue bound counts from here: tokenizing is part of the wait)
        self.fleet.check_overload()  # (before tokenizing: a flood is refused at once, 429 with Retry-After)
        lease = self.limits.enter(CURRENT_PRINCIPAL.get(), choices)
        try:
            requests = [dataclasses.replace(r, received_at=received) for r in await make_requests()]
            lease.charge(cost(requests))
            return await self.respond(make_renderer(requests), requests, request, stream, lease)
        except BaseException:
            lease.release()
            raise

    async def respond(self, renderer: ChatRenderer | CompletionRenderer, requests: list[GenerateRequest],
                      request: Request, stream: bool, lease: Lease | None = None) -> Response:
        generation = Generation(self.fleet, requests, request.receive, lease)  # refusals (429, ...) raise here
        if stream:
            try:
                await generation.started()  # refused in the queue: 429 (raised), not a 200 and an error event
            except ClientGone:
                return Response(status_code=499)
            return StreamingResponse(_stream(generation, renderer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for index, delta in generation.events():
                renderer.add(index, delta)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client is gone
        return _json(renderer.whole())


async def _stream(generation: Generation, renderer: ChatRenderer | CompletionRenderer) -> AsyncIterator[str]:
    """The SSE body: `data: {chunk}` lines, then `data: [DONE]`. An error after the 200 (the executor lost past
    --executor-retry-s, ...) is one `data: {"error": ...}` event before [DONE], as vLLM sends it."""
    try:
        for line in renderer.opening():
            yield line
        async for index, delta in generation.events():
            line = renderer.chunk(index, delta)
            if line is not None:
                yield line
        if renderer.include_usage:
            yield renderer.closing()
    except ClientGone:
        return
    except Exception as exc:  # the status line is sent: the error travels as an event
        yield sse(errors.of_exception(exc)[1])
    finally:
        generation.close()  # also when the server cancels this body because the client went away
    yield DONE


def _include_usage(opts: StreamOptions | None) -> bool:
    """The usage chunk at the end of a stream: include_usage, or vLLM's continuous_usage_stats (whose
    include_usage defaults to true, as vLLM 0.10.1.1's StreamOptions)."""
    return opts is not None and bool(opts.include_usage or (opts.continuous_usage_stats and
                                                            opts.include_usage is None))


def _continuous_usage(opts: StreamOptions | None, requests: list[GenerateRequest]) -> list[int] | None:
    """Per choice its prompt's tokens when every chunk carries usage (vLLM's continuous_usage_stats); else None."""
    if opts is None or not opts.continuous_usage_stats or opts.include_usage is False:
        return None
    return [len(r.prompt_ids) for r in requests]


def build_app(fleet: Fleet, workers: Executor | None, healthy: Callable[[], bool], max_body_bytes: int,
              metrics: MetricsHook | None = None, authenticator: Authenticator | None = None,
              auth_health: bool = False, limits: TokenLimits | None = None,
              allowed_origins: tuple[str, ...] = (), http_limits: HttpLimits | None = None) -> FastAPI:
    """The app. healthy(): whether /health answers 200 (some executor serves and the scheduler is not shutting
    down). metrics: the /metrics body, or None (404). authenticator: bearer tokens (None or off: none asked);
    limits: per-token shares of the completion routes. allowed_origins: CORS (--allowed-origins). http_limits:
    prompts per request (the connection limits are the server's: serve.py)."""
    tok = fleet.tokenizer
    reasoning = choose_reasoning(fleet.cfg.reasoning_parser, fleet.info.architecture, tok.chat_template,
                                 tok.encode_plain)
    front = _Front(fleet, workers, limits or TokenLimits(), (http_limits or HttpLimits()).max_prompts, reasoning)
    app = FastAPI(title="Tandem scheduler (OpenAI-compatible)", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if authenticator is not None and authenticator.on:  # before a byte of body is read
        app.add_middleware(TokenAuth, authenticator=authenticator, auth_health=auth_health)
    if allowed_origins:  # added last: outermost, so that a preflight (which carries no token) is answered
        app.add_middleware(Cors, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    errors.install(app)
    responses_route.install(app, front, ResponseStore(fleet.cfg.responses_store_size))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        errors.named_as(convert.param_names(body))
        n = body.n or 1
        opts = body.stream_options

        split: list[reasoning_output.ChoiceReasoning | None] = [None]

        async def requests() -> list[GenerateRequest]:
            adapter = await front.adapter_for(body.model)
            m = convert.chat_request(body, adapter, front.auto_tools)
            if front.reasoning is not None and front.reasoning.keep_special_tokens:
                m.keep_special_tokens = True  # (its markers are special tokens)
            made = await front.requests([m], n, convert.template_variables(body))
            made, split[0] = reasoning_output.prepare(front.reasoning, made, body.include_reasoning is not False)
            return made

        def renderer(requests: list[GenerateRequest]) -> ChatRenderer:
            return ChatRenderer(front.model_of(requests), len(requests), n, front.texts,
                                bool(body.return_tokens_as_token_ids), _include_usage(opts),
                                _continuous_usage(opts, requests), body.request_id,
                                logprobs=bool(body.logprobs), tool_mode=tool_calls.tool_mode(body, front.auto_tools),
                                prompt_logprobs=body.prompt_logprobs is not None, reasoning=split[0])

        return await front.generate(n, requests, renderer, request, bool(body.stream))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        errors.named_as(convert.param_names(body))
        n = body.n or 1
        opts = body.stream_options

        echo: list[tuple[tuple[int, ...], str]] = []  # with echo: per choice its prompt (ids, text)

        async def requests() -> list[GenerateRequest]:
            adapter = await front.adapter_for(body.model)
            made = await front.requests(convert.completion_requests(body, adapter, front.max_prompts), n)
            if body.echo:  # a text prompt echoes as sent; token ids as they decode
                texts = [p if isinstance(p, str) else await front.off_loop(fleet.tokenizer.decode, p, False)
                         for p in convert.prompts(body, front.max_prompts)]
                echo.extend((r.prompt_ids, texts[k // n]) for k, r in enumerate(made))
            return made

        def renderer(requests: list[GenerateRequest]) -> CompletionRenderer:
            return CompletionRenderer(front.model_of(requests), len(requests), n, front.texts,
                                      bool(body.return_tokens_as_token_ids), _include_usage(opts),
                                      _continuous_usage(opts, requests), body.request_id,
                                      logprobs=body.logprobs, echo=echo if body.echo else None,
                                      prompt_only=body.max_tokens == 0, prompt_logprobs=body.prompt_logprobs is not None)

        choices = len(convert.prompts(body, front.max_prompts)) * n  # 400 past --max-prompts-per-request
        return await front.generate(choices, requests, renderer, request, bool(body.stream))

    def cards() -> list[s.ModelCard]:
        info, names, same = fleet.info, front.names(), fleet.deterministic
        base = [s.ModelCard(id=name, created=front.created, root=info.model_id, max_model_len=info.max_seq_len,
                            deterministic=same) for name in names]
        return base + [s.ModelCard(id=a, created=front.created, root=info.model_id, parent=names[0],
                                   max_model_len=info.max_seq_len, deterministic=same)
                       for a in info.adapters if a not in names]

    @app.get("/v1/models")
    async def models() -> Response:
        await fleet.refresh_info()  # adapters may have been loaded or unloaded since
        return _json(s.ModelList(data=cards()))

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> Response:
        await front.adapter_for(model)  # 404 unless served
        card = next((c for c in cards() if c.id == model), None)
        if card is None:  # "" (the base model's alias in requests) names no card
            raise AdapterNotFound("GET /v1/models/{id} needs a model id (GET /v1/models lists them)")
        return _json(card)

    @app.get("/health")
    async def health() -> Response:
        if not healthy():
            raise Unavailable("no executor serves, or the scheduler is shutting down")
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        if (body.prompt is None) == (body.messages is None):
            raise BadParameter("prompt", "give exactly one of prompt or messages")
        if body.prompt is not None:
            if body.add_special_tokens is False:
                raise BadParameter("add_special_tokens", "add_special_tokens: false is not supported for prompt")
            m = pb.TokenizeRequest(text=body.prompt)
        else:
            if body.add_special_tokens or body.add_generation_prompt is False:
                raise BadParameter("add_generation_prompt", "messages are rendered with the generation prompt "
                                   "and no added special tokens, as chat completions see them")
            m = pb.TokenizeRequest(messages=convert.chat_messages(body.messages, tool_calls.tools_pb(body)))
        codec.check_input_size(m, fleet.cfg.max_prompt_chars)
        tok, info = fleet.tokenizer, fleet.info

        def run() -> s.TokenizeResponse:
            ids = codec.prompt_ids_from_pb(m, tok, info.vocab_size)
            return s.TokenizeResponse(count=len(ids), max_model_len=info.max_seq_len, tokens=ids,
                                      token_strs=tok.pieces(ids) if body.return_token_strs else None)

        return _json(await front.off_loop(run))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        vocab = fleet.info.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range: the vocabulary has {vocab} tokens")
        text = await front.off_loop(fleet.tokenizer.decode, body.tokens, False)
        return _json(s.DetokenizeResponse(prompt=text))

    add_pooling_routes(app, front)  # /v1/embeddings, /v1/score, /v1/rerank

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            return errors.response(404, "this server exports no metrics", None, "not_found")
        result = metrics()
        content, content_type = await result if inspect.isawaitable(result) else result
        return Response(content, media_type=content_type)

    return app
