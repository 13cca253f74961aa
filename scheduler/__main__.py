"""`python -m scheduler` / `tandem-scheduler`: continuous batching over one or more executors, tandem.generate.v1."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from tandem.errors import TandemError
from scheduler.engine import decode_bursts
from scheduler.engine import speculation
from scheduler.config import CPU_STEP_TOKENS, DEVICE_STEP_TOKENS, SchedulerConfig
from scheduler.http import limits as http_limits
from scheduler.pooling import config as pooling_config
from scheduler.vision import media_policy
from scheduler.reasoning.registry import CHOICES as REASONING_PARSERS
from scheduler.tool_parsers.registry import NAMES as TOOL_PARSERS
from scheduler.server import serve_async
from tandem.security.config import add_server_flags, server_security

_D = SchedulerConfig("")  # defaults, for the help text
_LIMITS = (  # (SchedulerConfig field, help with {} for the default)
    ("max_running", "sequences in the batch at once (default {})"),
    ("prefill_chunk", "most prompt tokens of one sequence per step (default {}; a chunk runs past it to hold a "
                      "Gemma 3 image's tokens whole)"),
    ("default_max_new_tokens", "max_new_tokens of requests that leave it unset (default {})"),
    ("max_waiting", "queued requests beyond which Generate is RESOURCE_EXHAUSTED (default {})"),
    ("max_message_mb", "request size limit in MiB (default {})"),
    ("max_prompt_chars", "characters of a text prompt, or of all chat messages together, beyond which Generate and "
                         "Tokenize are INVALID_ARGUMENT before tokenizing (default {})"),
    ("tokenizer_threads", "worker threads that tokenize and render chat templates off the event loop (default {})"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="tandem-scheduler",
        description="Serve tandem.generate.v1.GenerateService (streaming Generate, Tokenize, GetModelInfo; plus "
                    "vLLM's engine protocol vllm.grpc.engine.VllmEngine for SGLang's gateway smg, grpc.health.v1 "
                    "and server reflection) by batching requests continuously over Tandem "
                    "executors: each step is one UnifiedDecode with a token for every running sequence and prompt "
                    "chunks for waiting ones (or, while only decodes run and none waits, one Decode of several "
                    "steps: --decode-burst-ms). Waits for the executor to serve, then prints 'READY <addresses>' (with --http-port, the HTTP URL last).")
    ap.add_argument("--executor", required=True, action="append",
                    help="executor to drive: HOST:PORT, unix:PATH, or dns:///NAME:PORT for every address NAME resolves "
                         "to (e.g. a Kubernetes headless Service; looked up again every --resolve-interval). "
                         "Repeat it for several executors: each runs its own batch, new requests go to the best "
                         "scored (free KV, queued tokens, cached prefix: see docs/fleet.md), and a lost executor's requests "
                         "are recomputed on the others. All must serve the same model")
    ap.add_argument("--resolve-interval", type=float, default=_D.resolve_interval_s,
                    help=f"seconds between DNS lookups of dns:/// executor targets (default {_D.resolve_interval_s:.0f})")
    ap.add_argument("--host", default=_D.host, help="address to bind (default 127.0.0.1: loopback only)")
    ap.add_argument("--port", type=int, default=_D.port,
                    help=f"TCP port (default {_D.port}; 0 = any free port; -1 = none, with --uds)")
    ap.add_argument("--uds", help="also listen on this Unix domain socket path")
    ap.add_argument("--http-port", type=int, default=_D.http_port,
                    help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                         "/v1/responses, /v1/models, /health, /tokenize, /detokenize) on --host at this port (0 = any free port; "
                         "its URL is the last word of the READY line). Default: off")
    ap.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                    help="the names the base model answers to on the HTTP front (the request's `model`; GET "
                         "/v1/models lists them), e.g. --served-model-name smollm2 gpt-4o-mini; responses carry the "
                         "first. Default: the model's directory name. Adapters keep their own names")
    ap.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                    help="CORS on the HTTP front: web pages of these origins (e.g. https://app.example.com; * = any) "
                         "may call it from a browser; preflights are answered without a token, the calls still "
                         "need one with --auth-token-file. Default: none (browsers refuse cross-origin calls)")
    ap.add_argument("--reasoning-parser", default=_D.reasoning_parser, choices=REASONING_PARSERS, metavar="NAME",
                    help="split a thinking model's reasoning from its answer on the HTTP front (chat: "
                         "message.reasoning_content and .reasoning, delta.reasoning_content; /v1/responses: a "
                         f"reasoning item): {', '.join(REASONING_PARSERS[2:])} (vLLM's names), none, or auto = by "
                         "the model's family and chat template (default). Structured output and tool calls then "
                         "apply to the answer, after the thinking ends (docs/agents.md#reasoning)")
    ap.add_argument("--responses-store-size", type=int, default=_D.responses_store_size, metavar="N",
                    help="responses /v1/responses keeps in memory for previous_response_id (least recently used "
                         "dropped first; a dropped or unknown id is 404; store: false keeps none); 0 = none "
                         f"(default {_D.responses_store_size})")
    ap.add_argument("--chat-template", type=Path, metavar="FILE",
                    help="a Jinja chat template (as in tokenizer_config.json's chat_template) used for chat "
                         "requests instead of the model's own, e.g. for a model that has none. Default: the model's")
    ap.add_argument("--tool-call-parser", choices=TOOL_PARSERS, metavar="NAME",
                    help="how the model writes tool calls, for tool_choice \"auto\" on the HTTP front (OpenAI's "
                         "default when a request gives tools): hermes (<tool_call>{json}</tool_call>: Qwen2.5, "
                         "Qwen3, Hermes, SmolLM3), llama3_json (Llama 3.x JSON calls), mistral ([TOOL_CALLS]), "
                         "openai (GPT-OSS harmony), or none (\"auto\" refused). vLLM's names. Default: the "
                         "one the chat template shows, else none (docs/agents.md)")
    ap.add_argument("--tokenizer", help="directory with tokenizer.json (+ tokenizer_config.json / chat template), or a "
                                        ".gguf file (its tokenizer and chat template); default: the model the "
                                        "executor reports")
    ap.add_argument("--max-batch-tokens", type=int, metavar="N",
                    help="tokens per step, decodes and prefill chunks together, capped by the executor's own limit "
                         f"(default: {CPU_STEP_TOKENS} for an executor on a CPU, where 16 prompts packed in one step "
                         f"would all wait for the whole of it; {DEVICE_STEP_TOKENS} on a GPU; never below "
                         "--max-running)")
    for name, what in _LIMITS:  # integer limits: --max-running N sets SchedulerConfig.max_running
        default = getattr(_D, name)
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=what.format(default))
    ap.add_argument("--max-concurrent-rpcs", type=int, metavar="N",
                    help="GenerateService calls served at once (Generate streams, Tokenize, GetModelInfo; health "
                         "and reflection are not counted); more are RESOURCE_EXHAUSTED on arrival, naming this flag, "
                         "before any work (default --max-running + --max-waiting + 64: "
                         f"{_D.max_running + _D.max_waiting + 64} with the defaults). gRPC core is told to hold "
                         "8x as many calls not yet taken (at least 16384), so that it does not cancel them itself")
    ap.add_argument("--max-queue-time-s", "--max-queue-time", dest="max_queue_time", type=float,
                    default=_D.max_queue_time_s, metavar="S",
                    help="seconds a request may wait for its first step, from its arrival (tokenizing included); "
                         "at it (on time, also during a long step call) it ends "
                         "RESOURCE_EXHAUSTED / HTTP 429 with the reason and a Retry-After, nothing of it run (a request "
                         "that ran once, then was preempted, is never ended so). A new request whose wait, estimated "
                         "from the measured drain rate, is already past it is refused on arrival, before tokenizing "
                         f"(docs/operations.md#overload; default {_D.max_queue_time_s:.0f})")
    ap.add_argument("--stream-stall-timeout-s", type=float, default=_D.stream_stall_timeout_s,
                    help="a streaming client (HTTP or gRPC) that leaves a message unread this many seconds has its "
                         "request stopped and its KV freed (RESOURCE_EXHAUSTED, counted in tandem:stream_stalls); the "
                         f"generation never waits on a reader (default {_D.stream_stall_timeout_s:.0f})")
    ap.add_argument("--stream-max-buffered", type=int, default=_D.stream_max_buffered,
                    help="the same for a client that falls more than this many messages behind "
                         f"(default {_D.stream_max_buffered})")
    ap.add_argument("--executor-retry-s", type=float, default=_D.executor_retry_s,
                    help="when the executor is lost or restarts: seconds queued and in-flight requests wait for it to "
                         "serve again (they are then recomputed, clients see a pause); past it they end UNAVAILABLE "
                         f"(default {_D.executor_retry_s:.0f}; 0 = at once)")
    ap.add_argument("--connect-timeout", type=float, default=_D.connect_timeout_s,
                    help=f"seconds to wait at startup for the executor to serve (default {_D.connect_timeout_s:.0f})")
    ap.add_argument("--grace", type=float, default=_D.grace_s,
                    help=f"on SIGTERM/SIGINT: seconds running requests get to finish (default {_D.grace_s:.0f})")
    ap.add_argument("--metrics-port", type=int,
                    help="serve Prometheus metrics (GET /metrics) on --host at this port (0 = any free port, logged "
                         "as 'metrics on http(s)://...'), under this server's security: https with --tls-cert (a "
                         "client certificate with --tls-client-ca), an admin token with --auth-token-file; "
                         "default: none")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    add_server_flags(ap)
    _add_link_flags(ap)
    speculation.add_arguments(ap)
    decode_bursts.add_arguments(ap)
    http_limits.add_arguments(ap)
    pooling_config.add_arguments(ap)
    media_policy.add_arguments(ap)
    return ap.parse_args(argv)


def _add_link_flags(ap: argparse.ArgumentParser) -> None:
    """The scheduler as a client of its executors, and the per-token shares of its own clients."""
    g = ap.add_argument_group("to the executors, and per-token limits (docs/security.md)")
    g.add_argument("--executor-tls-ca", type=Path, metavar="PEM",
                   help="connect to the executors over TLS and check their certificates against this PEM CA")
    g.add_argument("--executor-tls-cert", type=Path, metavar="PEM",
                   help="mTLS: present this PEM client certificate to the executors (with --executor-tls-key)")
    g.add_argument("--executor-tls-key", type=Path, metavar="PEM", help="the PEM private key of --executor-tls-cert")
    g.add_argument("--executor-tls", action="store_true",
                   help="connect over TLS checked against the system's CA roots (implied by the flags above)")
    g.add_argument("--executor-tls-server-name", metavar="NAME",
                   help="the name the executors' certificates must carry (default: the host of --executor, and "
                        "for dns:///NAME:PORT the NAME, not the pod address dialled)")
    g.add_argument("--executor-token-file", type=Path, metavar="FILE",
                   help="send the first token of this file (token-file format) to the executors as "
                        "`authorization: Bearer`, on every call; re-read on change. An admin token also lets the "
                        "scheduler follow their KV events (prefix-aware routing with several executors)")
    g.add_argument("--max-concurrent-per-token", type=int, metavar="N",
                   help="choices one token may have in flight: a Generate call is one, an HTTP completion request "
                        "prompts x n; more are RESOURCE_EXHAUSTED / 429 for that token only, a request with more "
                        "choices than N alone is 400 (needs --auth-token-file; default: no limit)")
    g.add_argument("--max-queued-tokens-per-token", type=int, metavar="N",
                   help="tokens (prompt + max new tokens) one token's requests in flight may hold; a request "
                        "over it is RESOURCE_EXHAUSTED / 429 (needs --auth-token-file; default: no limit)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = SchedulerConfig(executor=args.executor[0], executors=tuple(args.executor),
                          resolve_interval_s=args.resolve_interval, host=args.host, port=args.port, uds=args.uds,
                          tokenizer=args.tokenizer, chat_template=args.chat_template,
                          tool_call_parser=args.tool_call_parser,
                          max_batch_tokens=args.max_batch_tokens,
                          max_running=args.max_running, prefill_chunk=args.prefill_chunk,
                          default_max_new_tokens=args.default_max_new_tokens, max_waiting=args.max_waiting,
                          max_concurrent_rpcs=args.max_concurrent_rpcs,
                          max_message_mb=args.max_message_mb, max_prompt_chars=args.max_prompt_chars,
                          tokenizer_threads=args.tokenizer_threads, max_queue_time_s=args.max_queue_time,
                          stream_stall_timeout_s=args.stream_stall_timeout_s, stream_max_buffered=args.stream_max_buffered,
                          executor_retry_s=args.executor_retry_s, connect_timeout_s=args.connect_timeout,
                          grace_s=args.grace, metrics_port=args.metrics_port, http_port=args.http_port,
                          served_model_names=tuple(args.served_model_name), allowed_origins=tuple(args.allowed_origins),
                          reasoning_parser=args.reasoning_parser, responses_store_size=args.responses_store_size,
                          speculative=speculation.from_args(args), bursts=decode_bursts.from_args(args),
                          http_limits=http_limits.from_args(args), pooling=pooling_config.from_args(args),
                          media=media_policy.from_args(args),
                          security=server_security(args), executor_tls_ca=args.executor_tls_ca,
                          executor_tls_cert=args.executor_tls_cert, executor_tls_key=args.executor_tls_key,
                          executor_tls=args.executor_tls, executor_tls_server_name=args.executor_tls_server_name,
                          executor_token_file=args.executor_token_file,
                          max_concurrent_per_token=args.max_concurrent_per_token,
                          max_queued_tokens_per_token=args.max_queued_tokens_per_token)
    try:
        cfg.validate()
        return asyncio.run(serve_async(cfg))
    except (TandemError, ValueError, OSError) as exc:
        print(f"tandem-scheduler: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
