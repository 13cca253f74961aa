"""The one load client of the serving, prefix, spec and structured benchmarks: asyncio + httpx against the
scheduler's OpenAI front, streamed requests (token ids -> /v1/completions, text -> /v1/chat/completions) in a closed
loop; vLLM's `return_tokens_as_token_ids` logprobs say exactly which tokens each SSE chunk carries. Kept because
exact token-id prompts, re-sent multi-turn ids and per-token greedy checks are what vllm bench serve and guidellm
cannot do (guidellm 0.8.1 joins prompts as text); open-loop request rates over text prompts are theirs to run.
Another server's own streaming API plugs in as a Dialect (llama-server's /completion: benchmarks/llama_cpp.py)."""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import httpx

from benchmarks.request_metrics import Record

Prompt = list[int] | str
_TOKEN_PREFIX = "token_id:"


def make_client(url: str, concurrency: int) -> httpx.AsyncClient:
    """An HTTP client for `url` (http://HOST:PORT) with a connection per request in flight."""
    n = max(concurrency, 1)
    return httpx.AsyncClient(base_url=url, timeout=None,
                             limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))


def request_body(prompt: Prompt, output_len: int, greedy_exact: bool = True, **extra: Any) -> tuple[str, dict]:
    """(path, JSON body): greedy, streamed, usage at the end; greedy_exact: EOS ignored (exactly output_len
    tokens). extra: more body fields (min_tokens, guided_grammar, ...)."""
    body: dict[str, Any] = {"model": "", "max_tokens": output_len, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "return_tokens_as_token_ids": True, **extra}
    if greedy_exact:
        body["ignore_eos"] = True
    if isinstance(prompt, str):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}], "logprobs": True}
    return "/v1/completions", {**body, "prompt": list(prompt), "logprobs": 0}


def _note(rec: Record, chunk: dict[str, Any], t: float) -> None:
    if "error" in chunk:  # an error after the stream began
        rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return
    for choice in chunk.get("choices") or ():
        lp = choice.get("logprobs") or {}
        tokens = [c["token"] for c in lp.get("content") or ()] or list(lp.get("tokens") or ())
        ids = [int(tok[len(_TOKEN_PREFIX):]) if tok.startswith(_TOKEN_PREFIX) else -1 for tok in tokens]
        if ids:
            rec.messages.append((t, len(ids)))
            rec.output_ids.extend(ids)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    u = chunk.get("usage")
    if u:
        details = u.get("completion_tokens_details") or {}
        rec.usage = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                     "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                     "accepted_tokens": details.get("accepted_prediction_tokens", 0),
                     "drafted_tokens": details.get("accepted_prediction_tokens", 0)
                     + details.get("rejected_prediction_tokens", 0)}
        rec.prompt_len = u["prompt_tokens"]  # a chat prompt's length is known once rendered


@dataclass(frozen=True)
class Dialect:
    """A server's streamed-completion API: `body(prompt, output_len, **extra)` -> (path, JSON body) of a request,
    `note(rec, chunk, t)` records one parsed SSE data chunk that arrived at time t."""
    body: Callable[..., tuple[str, dict]]
    note: Callable[[Record, dict[str, Any], float], None]


OPENAI = Dialect(request_body, _note)  # the OpenAI routes, vLLM's token-id logprobs (Tandem's front)


async def send(client: httpx.AsyncClient, rec: Record, prompt: Prompt, output_len: int, timeout: float,
               dialect: Dialect = OPENAI, **body: Any) -> Record:
    """Streams one request into rec: start/end, (time, tokens) of each token-carrying chunk, output ids, finish
    reason ("length" / "stop"), usage, or error. body: the dialect's request options (request_body's)."""
    path, payload = dialect.body(prompt, output_len, **body)

    async def stream() -> None:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    text = text[:200]
                rec.error = f"HTTP {response.status_code}: {text}"
                return
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    dialect.note(rec, json.loads(line[len("data: "):]), time.perf_counter())

    rec.start = time.perf_counter()
    try:
        await asyncio.wait_for(stream(), timeout)
    except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter()
    return rec


async def closed_loop(n: int, concurrency: int, send_i: Callable[[int], Awaitable[Any]]) -> None:
    """Requests 0..n-1, `concurrency` in flight: each finished one starts the next."""
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:  # one shared iterator
            await send_i(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))


async def run(url: str, prompts: Sequence[Prompt], output_len: int, concurrency: int | None, timeout: float,
              dialect: Dialect = OPENAI, **body: Any) -> list[Record]:
    """Every prompt once, `concurrency` in flight (None: all at once). body: the dialect's request options."""
    records = [Record(i, 0 if isinstance(p, str) else len(p)) for i, p in enumerate(prompts)]
    async with make_client(url, concurrency or len(prompts)) as client:
        def send_i(i: int) -> Awaitable[Record]:
            return send(client, records[i], prompts[i], output_len, timeout, dialect, **body)
        await closed_loop(len(prompts), concurrency or len(prompts), send_i)
    return records


def counters(url: str, names: Sequence[str]) -> dict[str, float]:
    """Prometheus counters of a scheduler's GET /metrics (url: its HTTP front), or of a full .../metrics URL
    (metrics_url: a server's --metrics-port); exact sample names, summed over their labels."""
    with urllib.request.urlopen(url if url.endswith("/metrics") else f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def metrics_url(server: Any) -> str:
    """The /metrics URL a server started with --metrics-port logged."""
    return re.search(r"metrics on (https?://\S+/metrics)", server.log()).group(1)
