"""Scheduler settings (CLI flags map 1:1 onto these fields; see scheduler/__main__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scheduler.http.limits import HttpLimits
from scheduler.pooling.config import PoolingConfig
from scheduler.reasoning.registry import AUTO, CHOICES as REASONING_PARSERS
from scheduler.tool_parsers.registry import NAMES as TOOL_PARSERS
from scheduler.vision.media_policy import MediaPolicy
from tandem.security.config import ServerSecurity


RPC_HEADROOM = 64  # calls --max-concurrent-rpcs allows by default beyond those that could run or queue
# --speculative ("auto": suffix, the measured batch rule, and the executor's draft model where it runs one;
# "draft_model": that model's drafts only)
METHODS = ("off", "ngram", "suffix", "auto", "draft_model")


# The step budget (--max-batch-tokens) when none is given, by the executor's device. On a CPU a step's time grows
# with its tokens (~25-60 ms per prompt token for a 1.7B model on 2 cores), so 16 prompts arriving together
# packed in one 2048-token step all wait for the whole of it (TTFT = the last one's); 512 (one --prefill-chunk)
# lets the first ones start decoding a quarter of the way in, for the same total work. A GPU's step costs little
# more for 2048 tokens than for 512: the larger budget keeps it busy.
CPU_STEP_TOKENS = 512
DEVICE_STEP_TOKENS = 2048


def step_tokens_default(device: str, max_running: int) -> int:
    """--max-batch-tokens when unset, for an executor on `device` ("cpu", "cuda:0", ...): never below
    max_running (every running sequence needs a token per step)."""
    return max(CPU_STEP_TOKENS if device.split(":")[0] == "cpu" else DEVICE_STEP_TOKENS, max_running)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "auto"  # "off"; "ngram": prompt-lookup drafts (scheduler/engine/draft_proposer.py); "suffix"/"auto":
    # those and earlier requests' outputs (scheduler/engine/suffix_proposer.py)
    num_tokens: int = 8  # most draft tokens per sequence and step (a copy's runs are tens of tokens long)
    ngram_min: int = 2
    ngram_max: int = 4
    # Decoding sequences in a step above which nobody drafts; None ("auto"): the measured break-even
    # (scheduler/engine/step_cost.py) decides, 4 until measured.
    max_batch: int | None = None
    suffix_cache_tokens: int = 131072  # tokens of earlier outputs kept for suffix drafts (~0.2 KB each)

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= 32:
            raise ValueError(f"--num-speculative-tokens must be in 1..32 (the executor's limit), got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= --ngram-min ({self.ngram_min}) <= --ngram-max ({self.ngram_max})")
        if self.max_batch is not None and self.max_batch < 0:
            raise ValueError(f"--speculative-max-batch must be >= 0, got {self.max_batch}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"--suffix-cache-tokens must be >= 0, got {self.suffix_cache_tokens}")


# Multi-step decode (scheduler/engine/decode_bursts.py): how long a burst of decode steps in one call may take.
@dataclass(frozen=True)
class BurstConfig:
    window_ms: float = 100.0  # a burst's target duration; 0 = one step per call, always
    max_steps: int = 16  # steps per call at most (the executor takes up to 256)

    def validate(self) -> None:
        if not self.window_ms >= 0:
            raise ValueError(f"--decode-burst-ms must be >= 0, got {self.window_ms}")
        if not 1 <= self.max_steps <= 256:
            raise ValueError(f"--max-decode-steps must be in 1..256, got {self.max_steps}")


@dataclass(frozen=True)
class SchedulerConfig:
    executor: str  # HOST:PORT (or unix:PATH, or dns:///NAME:PORT) of the executor to drive (the first)
    executors: tuple[str, ...] = ()  # every executor target (--executor repeated); () = (executor,)
    resolve_interval_s: float = 30.0  # between DNS lookups of dns:/// targets (executors that appear join)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50052  # 0 = any free port (printed when ready)
    uds: str | None = None  # also listen on this Unix socket
    tokenizer: str | None = None  # dir with tokenizer.json; None = the model dir the executor reports
    chat_template: Path | None = None  # a Jinja chat template file used instead of the model's own
    # tool_choice "auto": the tool-call syntax read (scheduler/tool_parsers/registry.py: hermes, llama3_json,
    # mistral, openai; "none" = off); None = the one the chat template shows, if any
    tool_call_parser: str | None = None
    # tokens per step (decodes + prefill chunks), capped by the executor's limit; None: by the executor's device
    # (step_tokens_default)
    max_batch_tokens: int | None = None
    max_running: int = 64  # sequences decoding or prefilling at once
    prefill_chunk: int = 512  # most prompt tokens of one sequence per step
    default_max_new_tokens: int = 256  # when a request leaves max_new_tokens unset
    max_waiting: int = 1024  # queued requests beyond which Generate answers RESOURCE_EXHAUSTED
    # GenerateService calls served at once (Generate streams, Tokenize, GetModelInfo); more are RESOURCE_EXHAUSTED
    # on arrival, before any work. None: max_running + max_waiting + RPC_HEADROOM (every request that could run
    # or queue, and room for Tokenize / GetModelInfo beside them).
    max_concurrent_rpcs: int | None = None
    max_message_mb: int = 16  # request size limit (prompts), and the executor channel's
    # Characters of a text prompt, or of all chat messages together (roles and contents), checked before
    # tokenizing: a larger input is INVALID_ARGUMENT without costing a tokenizer worker any time.
    max_prompt_chars: int = 1_000_000
    tokenizer_threads: int = 2  # workers that tokenize and render chat templates off the event loop
    # A request not admitted a first time within this time ends RESOURCE_EXHAUSTED (429), naming why; one whose
    # estimated wait is already past it is refused on arrival (scheduler/engine/admission.py).
    max_queue_time_s: float = 60.0
    # A streaming client that leaves a message unread this long, or lets more than stream_max_buffered pile up,
    # has its request stopped and its KV freed (scheduler/output/event_queue.py).
    stream_stall_timeout_s: float = 30.0
    stream_max_buffered: int = 4096
    # After the executor is lost (or restarts), queued and in-flight requests wait this long for it to serve
    # again (then they are recomputed); past it they end UNAVAILABLE. 0 = they end UNAVAILABLE at once.
    executor_retry_s: float = 60.0
    connect_timeout_s: float = 300.0  # at startup: how long to wait for the executor to serve
    reconnect_interval_s: float = 1.0  # while the executor is unreachable: how often to try it
    grace_s: float = 30.0  # on SIGTERM: time running requests get to finish before they are aborted
    metrics_port: int | None = None  # Prometheus GET /metrics on host:this (0 = any free port); None = none
    # OpenAI-compatible HTTP front (scheduler/http/) on --host: None = off, 0 = any free port (printed when ready).
    http_port: int | None = None
    # The names the base model answers to on the HTTP front (`model`; the first is the one responses carry);
    # empty: the model's directory name (GetInfo.model_id).
    served_model_names: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # CORS on the HTTP front: browser origins allowed ("*" = any); () = none
    # Splits a thinking model's reasoning from its answer on the HTTP front (scheduler/reasoning/): a parser's
    # name, "none", or "auto" (by the model's family and chat template).
    reasoning_parser: str = AUTO
    # Responses kept for /v1/responses' previous_response_id (least recently used dropped first); 0 = none.
    responses_store_size: int = 1024
    # The HTTP front's read timeouts, connection caps and prompts per request (--http-*-timeout-s, ...).
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # --speculative and its flags
    # Multi-step decode (scheduler/engine/decode_bursts.py): --decode-burst-ms, --max-decode-steps
    bursts: BurstConfig = field(default_factory=BurstConfig)
    # Embeddings and scoring (scheduler/pooling/): --max-embedding-inputs, --rerank-mode, --rerank-tokens, ...
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # image inputs (scheduler/vision/media_policy.py)
    security: ServerSecurity = ServerSecurity()  # this server's TLS, tokens, reflection (gRPC and HTTP alike)
    # The link to the executors: TLS when a CA or a client certificate is given (executor_tls_ca None: the
    # system's roots), mTLS with the certificate; the name their certificates must carry when it is not the
    # host dialled (default: a dns:/// target's NAME); the token sent to them.
    executor_tls_ca: Path | None = None
    executor_tls_cert: Path | None = None
    executor_tls_key: Path | None = None
    executor_tls_server_name: str | None = None
    executor_tls: bool = False  # TLS to the executors with the system's roots (no --executor-tls-ca)
    executor_token_file: Path | None = None
    # Per-token shares (scheduler/token_limits.py): requests in flight, and their tokens (prompt + max new).
    max_concurrent_per_token: int | None = None
    max_queued_tokens_per_token: int | None = None

    @property
    def executor_tls_on(self) -> bool:
        return self.executor_tls or self.executor_tls_ca is not None or self.executor_tls_cert is not None

    @property
    def rpc_limit(self) -> int:
        """--max-concurrent-rpcs, or its default derived from the queue sizes."""
        if self.max_concurrent_rpcs is not None:
            return self.max_concurrent_rpcs
        return self.max_running + self.max_waiting + RPC_HEADROOM

    @property
    def targets(self) -> tuple[str, ...]:
        return self.executors or (self.executor,)

    def validate(self) -> None:
        for name in ("max_batch_tokens", "max_running", "prefill_chunk", "default_max_new_tokens", "max_waiting",
                     "max_message_mb", "max_prompt_chars", "tokenizer_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        self.media.validate()
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError(f"--max-concurrent-rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError(f"--stream-stall-timeout-s must be > 0 seconds, got {self.stream_stall_timeout_s}")
        if self.stream_max_buffered < 1:
            raise ValueError(f"--stream-max-buffered must be >= 1, got {self.stream_max_buffered}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if not self.max_queue_time_s > 0:  # also rejects NaN
            raise ValueError(f"--max-queue-time-s must be > 0 seconds, got {self.max_queue_time_s}")
        if not self.resolve_interval_s > 0:
            raise ValueError(f"--resolve-interval must be > 0 seconds, got {self.resolve_interval_s}")
        for flag, value in (("--executor-retry-s", self.executor_retry_s), ("--grace", self.grace_s)):
            if not value >= 0:
                raise ValueError(f"{flag} must be >= 0 seconds, got {value}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535 (0 = any free port), got {self.http_port}")
        for name in self.served_model_names:
            if not name.strip() or len(name) > 256 or not name.isprintable():
                raise ValueError(f"--served-model-name: {name[:40]!r} is not a model name (1..256 printable "
                                 "characters, not only spaces)")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError("--served-model-name: a name is given twice")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.responses_store_size < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {self.responses_store_size}")
        self.speculative.validate()
        self.bursts.validate()
        self.http_limits.validate()
        self.pooling.validate()
        self.security.validate()
        for flag, value in (("--max-concurrent-per-token", self.max_concurrent_per_token),
                            ("--max-queued-tokens-per-token", self.max_queued_tokens_per_token)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
            if value is not None and self.security.auth_token_file is None:
                raise ValueError(f"{flag} needs --auth-token-file: without tokens there is no client to count for")
        if (self.executor_tls_cert is None) != (self.executor_tls_key is None):
            raise ValueError("--executor-tls-cert and --executor-tls-key go together: give both or neither")
        if self.executor_tls_server_name is not None and not self.executor_tls_on:
            raise ValueError("--executor-tls-server-name needs TLS to the executors (--executor-tls-ca, "
                             "--executor-tls-cert or --executor-tls)")
        if self.max_batch_tokens is not None and self.max_running > self.max_batch_tokens:
            raise ValueError(f"--max-running ({self.max_running}) cannot exceed --max-batch-tokens "
                             f"({self.max_batch_tokens}): every running sequence needs a token per step")
