"""An asyncio client of an OpenAI-compatible chat endpoint (Tandem's scheduler with --http-port, or vLLM):
streamed greedy chat requests of an exact output length, closed loop (N in flight) or open loop (given
arrival times), each request's timings in the same Record as benchmarks/serving_client.py (gRPC) fills.

Each request asks for `logprobs` with vLLM's `return_tokens_as_token_ids`, so every SSE chunk says exactly
which tokens it carries ("token_id:<id>"): a chunk's token count and the output ids come from there, not from
guessing tokens out of text (a chunk may carry several tokens, or none while text is held back). The
server must support those extras and `ignore_eos` (Tandem and vLLM do); OpenAI's own API does not.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from benchmarks import request_loops as loops
from benchmarks.request_metrics import Record

CHAT_PATH = "/v1/chat/completions"
_TOKEN_PREFIX = "token_id:"


def make_client(url: str, concurrency: int) -> httpx.AsyncClient:
    """An HTTP client for `url` (e.g. "http://127.0.0.1:8000") with a connection per request in flight."""
    return httpx.AsyncClient(base_url=url, timeout=None,
                             limits=httpx.Limits(max_connections=max(concurrency, 1),
                                                 max_keepalive_connections=max(concurrency, 1)))


def chat_payload(index: int, prompt: str, output_len: int, tag: str, model: str = "") -> dict[str, Any]:
    """A greedy streamed chat request of exactly output_len tokens (EOS ignored)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "return_tokens_as_token_ids": True, "user": f"bench-{tag}-{index}"}


def _token_ids(chunk: dict[str, Any]) -> list[int]:
    ids = []
    for choice in chunk.get("choices") or ():
        for t in ((choice.get("logprobs") or {}).get("content") or ()):
            token = t["token"]
            ids.append(int(token[len(_TOKEN_PREFIX):]) if token.startswith(_TOKEN_PREFIX) else -1)
    return ids


def _note(rec: Record, chunk: dict[str, Any], t: float) -> None:
    if "error" in chunk:  # an error after the stream began (vLLM and Tandem send it as an event)
        rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return
    ids = _token_ids(chunk)
    if ids:
        rec.messages.append((t, len(ids)))
        rec.output_ids.extend(ids)
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    u = chunk.get("usage")
    if u:
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rec.usage = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                     "cached_tokens": cached}
        rec.prompt_len = u["prompt_tokens"]  # the chat template's tokens included


async def send_one(client: httpx.AsyncClient, rec: Record, prompt: str, output_len: int, tag: str,
                   timeout: float, model: str = "") -> Record:
    """Streams one chat request and fills rec: start/end, (time, tokens) of each token-carrying chunk, output
    ids, finish_reason ("length" / "stop"), usage (prompt_len becomes usage.prompt_tokens), or error."""
    payload = chat_payload(rec.index, prompt, output_len, tag, model)

    async def stream() -> None:
        async with client.stream("POST", CHAT_PATH, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                rec.error = f"HTTP {response.status_code}: {_message(body)}"
                return
            async for line in response.aiter_lines():
                t = time.perf_counter()
                if line.startswith("data: ") and line != "data: [DONE]":
                    _note(rec, json.loads(line[len("data: "):]), t)

    rec.start = time.perf_counter()
    try:
        await asyncio.wait_for(stream(), timeout)
    except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter()
    return rec


def _message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200]


async def closed_loop(client: httpx.AsyncClient, prompts: list[str], output_len: int, concurrency: int, tag: str,
                      timeout: float, model: str = "") -> list[Record]:
    """Every prompt once, `concurrency` in flight: each finished request starts the next."""
    records = [Record(i, 0) for i in range(len(prompts))]
    await loops.closed_loop(len(prompts), concurrency,
                            lambda i: send_one(client, records[i], prompts[i], output_len, tag, timeout, model))
    return records


async def open_loop(client: httpx.AsyncClient, prompts: list[str], output_len: int, arrivals: list[float],
                    cap: int | None, tag: str, timeout: float, model: str = "") -> list[Record]:
    """Prompt i sent at arrivals[i] seconds from the start (at most `cap` in flight when given)."""
    records = [Record(i, 0) for i in range(len(prompts))]
    await loops.open_loop(records, arrivals, cap,
                          lambda i: send_one(client, records[i], prompts[i], output_len, tag, timeout, model))
    return records
