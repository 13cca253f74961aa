"""One attempt of a request, as a client sees it: a gRPC Generate stream, or an HTTP chat completion / completion
(SSE stream or one JSON body). Each ends with a gRPC status name — HTTP codes, SSE error events and transport
errors are mapped to the status of the same meaning, and `label` keeps what was seen ("grpc UNAVAILABLE",
"http 503", "http transport ReadError") — and, for streams, the gaps between token-bearing messages.
The client's own cancel or hang-up is `client_cancelled`, so that a CANCELLED the client did not ask for
stands out.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as pb
from tandem.generate.v1 import generate_pb2_grpc as pb_grpc
from tests.soak.workload import SEED, Spec

GAP_MIN_S = 0.25  # shorter gaps between messages are not kept (the longest stall is far longer in any run)
SEEDED_TEMPERATURE = 0.8
# HTTP status -> the gRPC status of the same meaning (scheduler/http/errors.py's table, read backwards).
STATUS_OF_HTTP = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  408: "DEADLINE_EXCEEDED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
                  501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


@dataclass
class Attempt:
    """started/ended: time.monotonic(). status: "OK" or a gRPC status name. tokens: gRPC's token ids (None
    over HTTP, where text is compared). gaps: (from, to) between consecutive stream events, start and end
    included, of GAP_MIN_S or more."""
    started: float
    stream: bool
    ended: float = 0.0
    status: str = "OK"
    label: str = "ok"
    detail: str = ""
    tokens: list[int] | None = None
    text: str = ""
    messages: int = 0
    client_cancelled: bool = False
    max_tokens: int = 0  # what the request asked for
    route: str = ""  # --all: where this attempt went (a re-sent direct request goes to the other scheduler)
    gaps: list[tuple[float, float]] = field(default_factory=list)
    _last: float = 0.0

    def tick(self) -> None:
        """A token-bearing message arrived."""
        now = time.monotonic()
        if self.stream and now - (self._last or self.started) >= GAP_MIN_S:
            self.gaps.append((self._last or self.started, now))
        self._last = now
        self.messages += 1

    def end(self, status: str = "OK", label: str = "ok", detail: str = "") -> "Attempt":
        self.ended = time.monotonic()
        if self.status == "OK":  # the first ending wins (a cancel, then the error it caused)
            self.status, self.label, self.detail = status, label, detail[:300]
        if self.stream and self.ended - (self._last or self.started) >= GAP_MIN_S:
            self.gaps.append((self._last or self.started, self.ended))
        return self


def _sampling(spec: Spec) -> cpb.SamplingParams:
    return cpb.SamplingParams(temperature=SEEDED_TEMPERATURE, seed=SEED) if spec.seeded else cpb.SamplingParams()


# A stream the scheduler ended as ABORTED (its --grace ran out after a SIGTERM: OK, with a finish reason saying the
# answer is cut short): the client re-sends it, like UNAVAILABLE (clients.py).
SHUTDOWN_ABORT = "SHUTDOWN_ABORT"
_ABORTED_DETAIL = "the stream ended with finish reason abort (the scheduler shut down before the request finished)"
SLOW_TOP_LOGPROBS = 20  # a slow reader's messages are large (the stall is meant to show in the server's buffers)


async def grpc_attempt(channel: grpc.aio.Channel, spec: Spec, prompt: str, max_tokens: int,
                       timeout: float, slow_pause_s: float = 0.0) -> Attempt:
    """Generate(text) streamed to its end, or cancelled as the spec plans. A slow reader (spec.slow) reads the
    first message, then nothing for slow_pause_s, then the rest."""
    req = pb.GenerateRequest(request_id=f"soak-{spec.n}", text=prompt, adapter=spec.adapter,
                             sampling=_sampling(spec), top_logprobs=SLOW_TOP_LOGPROBS if spec.slow else 0,
                             stopping=pb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True))
    att = Attempt(started=time.monotonic(), stream=True, tokens=[], max_tokens=max_tokens)
    call = pb_grpc.GenerateServiceStub(channel).Generate(req, timeout=timeout)
    timer = None

    def cancel() -> None:
        att.client_cancelled = True
        call.cancel()

    if spec.cancel_after == 0:
        timer = asyncio.get_running_loop().call_later(spec.cancel_delay_s, cancel)
    try:
        async for msg in call:
            if msg.token_ids:
                att.tick()
            att.tokens += msg.token_ids
            att.text += msg.text
            if spec.slow and att.messages == 1:
                await asyncio.sleep(slow_pause_s)  # the client stops reading; the server must not wait on it
            if spec.cancel_after and att.messages >= spec.cancel_after and not msg.finish_reason:
                cancel()
                return att.end("CANCELLED", "client cancel")
            if msg.finish_reason == pb.FINISH_REASON_ABORTED:
                return att.end(SHUTDOWN_ABORT, "grpc finish ABORTED", _ABORTED_DETAIL)
        return att.end()
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
        if att.client_cancelled and code == "CANCELLED":
            return att.end("CANCELLED", "client cancel")
        return att.end(code, f"grpc {code}", exc.details() or "")
    except asyncio.CancelledError:
        if att.client_cancelled:  # grpc.aio ends a call cancelled from this side this way
            return att.end("CANCELLED", "client cancel")
        call.cancel()
        raise
    finally:
        if timer is not None:
            timer.cancel()


def _http_body(spec: Spec, prompt: str, max_tokens: int, model: str) -> tuple[str, dict]:
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "stream": spec.stream,
                  "temperature": SEEDED_TEMPERATURE if spec.seeded else 0.0}
    if spec.seeded:
        body["seed"] = SEED
    if spec.adapter or model:  # (a router routes by the model's name)
        body["model"] = spec.adapter or model
    if spec.slow:
        body.update(logprobs=True, top_logprobs=SLOW_TOP_LOGPROBS)
    if spec.protocol == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _error_status(code: int, payload: object) -> tuple[str, str]:
    """(status, detail) of an HTTP error response: the body's `code` when it names a gRPC status, else the
    HTTP status's."""
    err = payload.get("error") if isinstance(payload, dict) else None
    named = str(err.get("code") or "").upper() if isinstance(err, dict) else ""
    detail = str(err.get("message", "")) if isinstance(err, dict) else str(payload)[:200]
    if named == "MODEL_NOT_FOUND":
        named = "NOT_FOUND"
    status = named if named in grpc.StatusCode.__members__ else STATUS_OF_HTTP.get(code, f"HTTP_{code}")
    return status, detail


def _piece(kind: str, choice: dict, stream: bool) -> str:
    if kind == "chat":
        return (choice.get("delta") if stream else choice.get("message", {})).get("content") or ""
    return choice.get("text") or ""


async def http_attempt(client: httpx.AsyncClient, base_url: str, spec: Spec, prompt: str,
                       max_tokens: int, model: str = "", slow_pause_s: float = 0.0) -> Attempt:
    """POST the chat completion or completion; a planned hang-up closes the connection (a stream after k
    chunks, or anything after a delay); a slow reader reads one chunk, then nothing for slow_pause_s."""
    path, body = _http_body(spec, prompt, max_tokens, model)
    att = Attempt(started=time.monotonic(), stream=spec.stream, max_tokens=max_tokens)
    try:
        if spec.cancel_after == 0:
            try:
                async with asyncio.timeout(spec.cancel_delay_s):
                    await _http_exchange(client, base_url + path, spec, body, att, slow_pause_s)
            except TimeoutError:
                att.client_cancelled = True
                return att.end("CANCELLED", "client hang-up")
        else:
            await _http_exchange(client, base_url + path, spec, body, att, slow_pause_s)
        return att.end()
    except httpx.TimeoutException as exc:
        return att.end("DEADLINE_EXCEEDED", f"http transport {type(exc).__name__}", str(exc))
    except httpx.TransportError as exc:  # refused, reset, closed mid-body: the server went away
        return att.end("UNAVAILABLE", f"http transport {type(exc).__name__}", str(exc))


async def _http_exchange(client: httpx.AsyncClient, url: str, spec: Spec, body: dict, att: Attempt,
                         slow_pause_s: float = 0.0) -> None:
    if not spec.stream:
        resp = await client.post(url, json=body)
        payload = _json_or_text(resp.content)
        if resp.status_code != 200:
            status, detail = _error_status(resp.status_code, payload)
            att.end(status, f"http {resp.status_code}", detail)
            return
        att.text = _piece(spec.protocol, payload["choices"][0], stream=False)
        att.tick()
        if payload["choices"][0].get("finish_reason") == "abort":
            att.end(SHUTDOWN_ABORT, "http finish abort", _ABORTED_DETAIL)
        return
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            status, detail = _error_status(resp.status_code, _json_or_text(await resp.aread()))
            att.end(status, f"http {resp.status_code}", detail)
            return
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:  # an error after the 200: one event, then [DONE]
                status, detail = _error_status(0, event)
                att.end(status, f"http sse {status.lower()}", detail)
                return
            if any(c.get("finish_reason") == "abort" for c in event.get("choices", [])):
                att.end(SHUTDOWN_ABORT, "http finish abort", _ABORTED_DETAIL)
            piece = "".join(_piece(spec.protocol, c, stream=True) for c in event.get("choices", []))
            if piece:
                att.tick()
                att.text += piece
                if spec.slow and att.messages == 1:
                    await asyncio.sleep(slow_pause_s)  # the client stops reading (the connection stays open)
                if spec.cancel_after and att.messages >= spec.cancel_after:
                    att.client_cancelled = True  # leaving the block closes the connection mid-body
                    att.end("CANCELLED", "client hang-up")
                    return
        if not done:
            att.end("UNAVAILABLE", "http stream ended without [DONE]")


def _json_or_text(content: bytes) -> object:
    try:
        return json.loads(content)
    except ValueError:
        return content[:200].decode("utf-8", "replace")
