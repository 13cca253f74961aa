"""The in-process Executor: serves the operations of the executor API over a model stack (the model, the
paged KV pool, the decode step: built by model_stack.py); usable without a network.

Its operations follow the Rust engine's `ModelExecutor` trait the design descends from (prefill, decode, batch
decode, unified_decode, forward_verify, truncate_kv, release_cache). Every operation validates its request
before touching state and runs under one model lock. A batch item that is wrong on its own fails alone (its
result carries the error; nothing of it is written); any other error leaves every cache as it found it
(blocks, lengths, tokens, registered sampling), whatever step it happens at.

Every cache belongs to a session (sessions.py); an operation sees only its session's caches (`session=""`,
the default, is the anonymous session, so direct callers need no sessions). Locking: operations that
change caches or run the model hold the model lock (executor_service/step/op_lock.py), control operations (release, truncate,
close, reap, unload) ahead of queued model calls; reads (info, kv_usage, list_caches, list_adapters,
metrics, keep_alive, open_session) take only the short locks of what they read and never wait for a
model call.
"""
from __future__ import annotations

import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Sequence

from executor_service.adapters import AdapterRegistry
from executor_service.draft_model_stack import load_draft_model
from executor_service.step.draft_model import draft_model_info
from executor_service.step.model_drafts import ModelDrafts
from executor_service.step.batch_step import BatchStep
from executor_service.kv.cache_table import CacheState, CacheStore, CacheTable
from executor_service.config import ExecutorConfig
from executor_service.step.decode_steps import MAX_DECODE_STEPS, run_decode_steps  # noqa: F401  (re-exported)
from executor_service.kv.events.hub import KvEventHub, Subscription
from executor_service.kv.fingerprint import fingerprint_of
from executor_service.kv.tiers.link import TierLink
from executor_service.kv.transfer.pinned_export import KvTransfer
from executor_service.memory_probe import resident_memory_bytes
from executor_service.metrics.op_stats import ExecutorMetrics, MetricsSnapshot
from executor_service.model_stack import ModelStack
from executor_service.step.op_lock import OpLock
from executor_service.step.pooling import pooling_rules
from executor_service.kv.prefix_cache import PrefixCache, PrefixCacheStats
from executor_service.kv.prompt_logprob_store import restore_prompt_logprobs
from executor_service.request_validation import RequestValidator, check_release_with_step, name_item, unnamed
from executor_service.sessions import ANONYMOUS, Session, SessionRegistry
from executor_service.tp.stack import build_stack
from executor_service.vision.embedding_cache import ImageEmbeddings, VisionStats
from executor_service.vision.image_checks import vision_info
from executor_service.vision.mrope import reuse_images
from executor_service.types import (AdapterInfo, CacheRef, CreateCacheItem, CreateCacheResult, DecodeItem,
                                    DecodeResult, ExecutorInfo, OutputOptions, PrefillResult, SessionLease,
                                    SessionListing, StepResults, UnifiedItem, UnifiedResult, VerifyResult)
from models.moe import SparseMoeBlock
from tandem import capabilities as caps
from tandem.errors import AdapterInUse, CacheStateConflict, InvalidRequest, PositionMismatch, TandemError
from tandem.kv_usage import KvUsage
from tandem.sampling_params import SamplingParams

# What this build always does (tandem/capabilities.py says what each name promises); "prefix_caching" and the
# decode step's names (ModelStack.capabilities) depend on the configuration.
CAPABILITIES = (caps.LORA, caps.PAGED_KV, caps.UNIFIED_DECODE, caps.CHUNKED_PREFILL, caps.MULTI_STEP_DECODE,
                caps.FORWARD_VERIFY, caps.TRUNCATE_CACHE, caps.LOGITS_OUTPUT, caps.TOP_LOGPROBS,
                caps.SEEDED_SAMPLING, caps.SESSIONS, caps.ITEM_STATUS, caps.REGISTERED_SAMPLING,
                caps.CREATE_CACHE, caps.KV_EVENTS, caps.SPECULATIVE_DRAFTS, caps.TOKEN_MASKS,
                caps.RELEASE_WITH_STEP, caps.PROMPT_LOGPROBS, caps.MULTI_STEP_DRAFTS, caps.KV_TRANSFER)


class Executor:
    """The façade of the in-process API. Its parts, each in a file named for it: the model stack
    (model_stack.py), request validation (request_validation.py), the cache table (executor_service/kv/cache_table.py), one step
    over a session's caches (executor_service/step/batch_step.py) and its packed forward (executor_service/step/batch.py), adapters (adapters.py),
    metrics (executor_service/metrics/op_stats.py)."""

    def __init__(self, config: ExecutorConfig, stack: ModelStack | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """stack: the model stack to serve (model_stack.py), built from config when None; one executor per
        stack (its KV pool holds this executor's caches). clock: monotonic seconds for leases and cache ages
        (tests pass a fake one)."""
        self.config = config
        self.instance_id = uuid.uuid4().hex  # a restart is visible to clients as a new id
        self.stack = stack = stack if stack is not None else build_stack(config)  # (tensor-parallel or not)
        # What other code reads of the stack, under the names it always had.
        self.device, self.model, self.model_config = stack.device, stack.model, stack.model_config
        self.generation, self.quantization_kernel = stack.generation, stack.quantization_kernel
        self.kv, self.kv_pool, self.runner = stack.kv, stack.kv_pool, stack.runner
        self.decode_step, self.compiled = stack.decode_step, stack.compiled
        cfg, dtype = stack.model_config, stack.dtype
        self.events = KvEventHub(config.max_kv_subscribers, config.kv_events_buffer)
        self.prefix = PrefixCache(self.kv, config.prefix_caching, self.events)
        self.adapters = AdapterRegistry(cfg, self.device, dtype, config.adapter_root, config.max_adapters_on_device,
                                        config.max_lora_rank)
        for name, path in config.adapters:  # the operator's preloads (allowed without a root)
            self.adapters.load(name, path, trusted=True)
        self.metrics = ExecutorMetrics()
        self.sessions = SessionRegistry(config.session_ttl_s, clock)
        self._store = CacheStore(clock)
        self._scope: CacheTable | None = None  # the session view of the operation in progress
        self.pooling = pooling_rules(config, cfg)  # pooled items: embeddings, scores (executor_service/step/pooling.py)
        # --draft-model: loaded after the served model's pool, out of what it leaves (draft_model_stack.py)
        self.draft = load_draft_model(config, stack)
        drafts = self.draft and ModelDrafts(self.draft, self.kv, config.max_batch_tokens, cfg.max_position_embeddings)
        self._validator = RequestValidator(cfg, config.max_batch_tokens, self.adapters, self.pooling,
                                           draft_model=self.draft is not None)
        vision = getattr(self.model, "vision", None)  # images: embeddings computed once per image, by content hash
        self.runner.images = self.images = vision and ImageEmbeddings(vision, self.device, config.vision_cache_images)
        self._step = BatchStep(self.runner, self._validator, self.prefix, self.adapters, self.metrics, drafts)
        self._lock = OpLock()
        self.transfer = KvTransfer(self, fingerprint_of(config, stack))
        if self.prefix.enabled:  # evicted blocks kept in host memory / on disk (executor_service/kv/tiers/store.py)
            self.prefix.tiers = TierLink.open(self.kv, self.transfer.fingerprint, config.kv_tiers, self.events,
                                              lambda: self.control_op("kv_tier"))

    # ----------------------------------------------------------------- operations
    def prefill(self, token_ids: Sequence[int], cache_id: str | None = None,
                sampling: SamplingParams = SamplingParams(), output: OutputOptions = OutputOptions(),
                adapter: str = "", session: str = ANONYMOUS) -> PrefillResult:
        """Runs a prompt (or the next chunk of one, when cache_id names an existing cache) and samples the
        token that follows it. The sampled token is not written to the cache: feed it to decode. `sampling`
        is registered with the cache (items that later send none use it)."""
        with self._op("prefill", session):
            pos = 0
            if cache_id:
                state = self._caches.get(cache_id)
                if state.num_output_tokens:
                    raise CacheStateConflict(f"cache {cache_id!r} is already decoding ({state.num_output_tokens} "
                                             "output tokens): its prompt cannot grow; use Decode or UnifiedDecode")
                pos = state.table.length
            item = UnifiedItem(tuple(token_ids), cache_id, pos, True, sampling, output, adapter)
            (result,) = self._run([item])
            if result.error is not None:  # a single-item call: the item's error is the call's
                raise unnamed(result.error)
            state = self._caches[result.cache.cache_id]
            state.prompt_len = result.cache.seq_len  # every Prefill chunk is prompt
            return PrefillResult(result.cache, result.output, state.cached_tokens)

    def unified_decode(self, items: Sequence[UnifiedItem], session: str = ANONYMOUS,
                       release: Sequence[str] = ()) -> StepResults[UnifiedResult]:
        """One packed forward over a mix of prefill chunks and decodes; output for final chunks only. An item
        that is wrong on its own gets its error in its result (and writes nothing); the others run. Raises
        only for the call as a whole (no items, over max_batch_tokens, KV pool full, device out of memory),
        and then nothing was written. release: caches of the session freed first, as release_cache frees
        them, in the same operation (their blocks serve this call's items; they stay freed if the call then
        fails); at most MAX_RELEASE_WITH_STEP, else InvalidRequest before any is. results.released: how many."""
        check_release_with_step(release)
        with self._op("unified_decode", session):
            released = self._release(release)[0] if release else 0
            results = self._run(items)
            return StepResults(results, released, self._step.draft_seconds)

    def decode(self, items: Sequence[DecodeItem], num_steps: int = 1, session: str = ANONYMOUS,
               release: Sequence[str] = ()) -> StepResults[DecodeResult]:
        """Feeds each item's token at its cache's position and samples the next, num_steps times, feeding
        each sampled token back. An item stops early at one of its stop tokens or at the model's length
        limit; if the KV pool fills after the first step, every item stops there (partial results). An item
        wrong on its own fails alone (its result's error). Any other failure, at any step, raises with every
        cache as it was before the call. release: as unified_decode's."""
        check_release_with_step(release)
        with self._op("decode", session):
            released = self._release(release)[0] if release else 0
            return StepResults(run_decode_steps(items, num_steps, self._caches, self.kv, self._validator, self._run,
                                                self.model_config.max_position_embeddings), released)

    def forward_verify(self, cache: CacheRef, token_ids: Sequence[int], output: OutputOptions = OutputOptions(),
                       adapter: str = "", session: str = ANONYMOUS) -> VerifyResult:
        """Writes N+1 tokens at the cache's position in one forward and returns, for every one of them, the
        greedy prediction of the token after it (and/or its logits). Truncate afterwards to keep only the
        accepted prefix."""
        with self._op("forward_verify", session):
            if not cache.cache_id:
                raise InvalidRequest("forward_verify needs {field} of an existing cache (prefill)", "cache.cache_id")
            item = UnifiedItem(tuple(token_ids), cache.cache_id, cache.seq_len, True, None, output, adapter)
            positions = self._step.verify(item, self._caches)
            return VerifyResult(self._caches.ref(cache.cache_id), positions)

    def truncate_cache(self, cache_id: str, new_len: int, session: str = ANONYMOUS) -> CacheRef:
        """Rolls a cache back to its first new_len tokens (speculative decoding rejects), freeing whole blocks."""
        with self._op("truncate_cache", session, control=True):
            state = self._caches.get(cache_id)
            if new_len < 0 or new_len > state.table.length:
                raise PositionMismatch(
                    f"cache {cache_id!r} holds {state.table.length} tokens; cannot truncate it to {new_len}")
            self.kv.truncate(state.table, new_len)
            state.truncate(new_len)
            return self._caches.ref(cache_id)

    def release_cache(self, cache_ids: Sequence[str], session: str = ANONYMOUS) -> tuple[int, list[str]]:
        """Frees every named cache of the session. Idempotent: unknown ids (another session's included) are
        returned, not an error."""
        with self._op("release_cache", session, control=True):
            return self._release(cache_ids)

    def create_caches(self, items: Sequence[CreateCacheItem], session: str = ANONYMOUS) -> list[CreateCacheResult]:
        """Creates a cache per prompt, holding the longest cached prefix of it (whole blocks, never the whole
        prompt; nothing with prefix caching off), pinned at once. An item wrong on its own fails alone."""
        with self._op("create_cache", session, control=True):
            self._validator.check_create_call(items)
            results = []
            for n, it in enumerate(items):
                try:
                    self._validator.create_item(it)
                except TandemError as exc:
                    results.append(CreateCacheResult(CacheRef("", 0), 0, name_item(exc, n)))
                    continue
                state = self._step.new_state(it.adapter, it.cache_salt)
                spans = [(im.offset, im.length, im.content_hash) for im in it.images]
                state.cached_tokens = self.prefix.match(state.table, it.token_ids, state.root, it.prompt_logprobs,
                                                        spans)
                state.tokens = list(it.token_ids[:state.cached_tokens])
                reuse_images(state, it.images)  # (the reused blocks show them)
                self.metrics.caches_created += 1
                results.append(CreateCacheResult(CacheRef(self._caches.add(state), state.cached_tokens),
                                                 state.cached_tokens,
                                                 prompt_logprobs=restore_prompt_logprobs(state, self.prefix.logprobs,
                                                                                         it.prompt_logprobs)))
            return results

    def subscribe_kv_events(self) -> Subscription:
        """A KV event subscription, starting with a snapshot of the indexed blocks (taken under the model lock:
        no event falls between the snapshot and the first queued event)."""
        with self._op("subscribe_kv_events", control=True):
            return self.events.subscribe(self.prefix.snapshot())

    def prefix_stats(self) -> PrefixCacheStats:
        return self.prefix.stats()

    def load_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Loads a PEFT LoRA directory from inside the adapter root; nothing changes on any error."""
        with self._op("load_adapter"):
            self.adapters.load(name, path)
            return self._adapter_info(name)

    def unload_adapter(self, name: str) -> None:
        with self._op("unload_adapter", control=True):
            self.adapters.get(name)
            users = self._store.adapter_users().get(name, 0)
            if users:
                raise AdapterInUse(f"adapter {name!r} is used by {users} live caches; release them first "
                                   "(unloading never cuts a sequence short)")
            self.adapters.unload(name)
            self.runner.lora_stacks.clear()

    def list_adapters(self) -> list[AdapterInfo]:
        """Under the adapter registry's and the cache store's own locks: never waits for a model call."""
        return self.adapters.infos(self._store.adapter_users())

    def kv_usage(self) -> KvUsage:
        u = self.kv.usage()
        return KvUsage(u.block_size, u.total_blocks, u.free_blocks, len(self._store), u.cached_blocks)

    # ----------------------------------------------------------------- sessions
    def open_session(self, client_name: str = "") -> SessionLease:
        session = self.sessions.open(client_name)
        return SessionLease(session.session_id, self.sessions.ttl_s, self.instance_id)

    def keep_alive(self, session_id: str) -> tuple[float, int]:
        """Renews the lease; returns (seconds until it ends unless renewed, caches the session holds)."""
        self.sessions.renew(session_id)
        return self.sessions.ttl_s, len(self._store.owned(session_id))

    def close_session(self, session_id: str) -> int:
        """Forgets the session and releases its caches (after the call in progress, which may be creating
        some); returns how many. Idempotent: an unknown session releases nothing."""
        with self._op("close_session", control=True):
            session = self.sessions.close(session_id)
            return self._release_session(session) if session is not None else 0

    def reap_lapsed(self) -> int:
        """Releases the caches of every session whose lease lapsed (the server's reaper calls this every
        TTL/4; in-process users call it when they want leases enforced). Returns the caches released."""
        with self._op("reap_sessions", control=True):
            return sum(self._release_session(s) for s in self.sessions.take_lapsed())

    def hold_session(self, session_id: str) -> ContextManager[Session]:
        """Keeps a session from lapsing while a call of it waits for the model thread (the servicer's)."""
        return self.sessions.pinned(session_id)

    def list_caches(self, session_id: str | None = None) -> list[SessionListing]:
        """Sessions (oldest first) with their caches (oldest first); one session, or every session (None:
        the anonymous one only when it holds caches). Renews nothing."""
        return self._store.listings(self.sessions, session_id)

    def info(self) -> ExecutorInfo:
        cfg = self.model_config
        return ExecutorInfo(
            model_id=self.config.model_dir.name, model_dir=str(self.config.model_dir),
            architecture=cfg.checkpoint_architecture or cfg.architecture,
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            max_seq_len=cfg.max_position_embeddings, dtype=str(self.stack.dtype).removeprefix("torch."),
            device=str(self.device), eos_token_ids=self.generation.eos_token_ids,
            bos_token_id=self.generation.bos_token_id, kv=self.kv_usage(), instance_id=self.instance_id,
            max_adapters_on_device=self.adapters.max_on_device, session_ttl_s=self.sessions.ttl_s,
            max_batch_tokens=self.config.max_batch_tokens, adapters=self.adapters.names(),
            capabilities=CAPABILITIES + ((caps.PREFIX_CACHING,) if self.prefix.enabled else ())
            + ((caps.POOLING,) if self.pooling.info is not None else ())
            + ((caps.DRAFT_MODEL,) if self.draft is not None else ())
            + ((caps.VISION,) if self.images is not None else ())
            + self.stack.decode_capabilities,
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_layers=tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), kv_pool=self.kv_pool,
            resident_memory_bytes=resident_memory_bytes(), deterministic=self.config.deterministic,
            quantization=_quantization(self.config.quantization, self.stack.weight_format),
            role=self.config.kv_transfer.role, kv_fingerprint=self.transfer.fingerprint,
            tensor_parallel_size=self.config.tensor_parallel_size, kv_dtype=self.stack.kv_dtype,
            attention_backend=self.stack.attention_backend, pooling=self.pooling.info,
            draft_model=draft_model_info(self.draft) if self.draft is not None else None,
            vision=vision_info(cfg.vision, self.config.vision_cache_images) if self.images is not None else None)

    def expert_load(self) -> dict[int, list[int]]:
        """MoE layer -> tokens routed to each of its experts since start."""
        return {m.layer: m.expert_tokens.tolist() for m in self.model.modules() if isinstance(m, SparseMoeBlock)}

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.metrics.snapshot()

    def vision_stats(self) -> VisionStats | None:  # None: a text-only model
        return self.images.stats() if self.images is not None else None

    def cache_length(self, cache_id: str, session: str = ANONYMOUS) -> int:
        return self._store.view(session).get(cache_id).table.length

    def cache_ref(self, cache_id: str, session: str = ANONYMOUS) -> CacheRef:
        """The cache as it is now; length 0 when the session does not hold it (for failed items' results)."""
        return self._store.view(session).ref(cache_id)

    # ----------------------------------------------------------------- for executor_service/kv/transfer/pinned_export.py / kv_tiers.py
    def control_op(self, name: str, session: str | None = None) -> ContextManager[None]:
        """The model lock for a short state change outside a model call (a transfer's chunk)."""
        return self._op(name, session, control=True)

    def cache_table(self, session: str) -> CacheTable:
        return self._store.view(session)

    def new_cache_state(self, adapter: str) -> CacheState:
        return self._step.new_state(adapter)

    # ----------------------------------------------------------------- internals
    @property
    def _caches(self) -> CacheTable:
        """The caches the operation in progress may address: its session's (outside an operation, the
        anonymous session's). Set by _op under the model lock, so exactly one operation uses it at a time."""
        return self._scope if self._scope is not None else self._store.view(ANONYMOUS)

    @contextmanager
    def _op(self, name: str, session: str | None = None, control: bool = False) -> Iterator[None]:
        """Holds the model lock for one operation (control ones ahead of queued model calls). With a session:
        SessionNotFound unless it is live; the operation sees only its caches, and the lease is held for the
        operation's duration and renewed at its end."""
        start = time.perf_counter()
        with (self.sessions.pinned(session) if session is not None else nullcontext()), self._lock.hold(control):
            waited = time.perf_counter() - start
            try:
                if session is not None:
                    self.sessions.find(session)  # closed while this call waited for the lock: NOT_FOUND
                    self._scope = self._store.view(session)
                yield
            finally:
                self._scope = None
                self.metrics.record_op(name, time.perf_counter() - start, waited)

    def _release(self, cache_ids: Sequence[str]) -> tuple[int, list[str]]:
        """Frees the named caches of the operation's session (release_cache, and the release ids of step
        calls); returns (how many, the ids it did not hold)."""
        released, unknown = 0, []
        for cid in cache_ids:
            state = self._caches.pop(cid)
            if state is None:
                unknown.append(cid)
                continue
            self._free(state)
            released += 1
        self.metrics.caches_released += released
        return released, unknown

    def _release_session(self, session: Session) -> int:
        """Frees every cache of a session (under the model lock: no call can be extending them)."""
        states = self._store.pop_session(session.session_id)
        for state in states:
            self._free(state)
        return len(states)

    def _free(self, state: CacheState) -> None:
        """A cache's blocks back to the pool, and its draft cache's to the draft pool."""
        self.kv.release(state.table)
        if self.draft is not None:
            self.draft.free(state)

    def _run(self, items: Sequence[UnifiedItem]) -> list[UnifiedResult]:
        return self._step.run(items, self._caches)

    def _adapter_info(self, name: str) -> AdapterInfo:
        return next(a for a in self.list_adapters() if a.name == name)


def _quantization(flag: str, weight_format: str) -> str:
    """GetInfo's quantization: --quantization's, after the GGUF block formats kept ("gguf-blocks:Q4_K+Q6_K",
    then ",int8" where --quantization applied to the file's float matrices)."""
    if weight_format == "float":
        return flag
    return weight_format if flag == "none" else f"{weight_format},{flag}"
