"""A gRPC proxy in front of a real executor that checks what a client sends against the capabilities it was
shown, and can play an older executor.

    with CapabilityProxy(executor.address, hide={caps.RELEASE_WITH_STEP}) as proxy:
        start a scheduler with --executor proxy.address ...
        assert proxy.violations == []

Every call of the executor's service (and grpc.health.v1) is forwarded as raw bytes, with its metadata and
deadline, and answered with the executor's answer or status. What it changes, to play an executor of a release
that lacked the `hide` capabilities: GetInfo answers without them, and the calls that are those capabilities
(CreateCache, SubscribeKvEvents, OpenSession ...) answer UNIMPLEMENTED, as a server without the method does.
What it records: for each request, the capabilities it relies on (`used`: a field or a call an executor without
the capability would ignore or not know); one the client was not shown is a violation, except the calls a
client may probe because their UNIMPLEMENTED has a fallback (`PROBES`). What relies on what: CALLS and
FIELD_GATES below; a field added to the contract under a new capability belongs there (a test of
tests/contract/test_mixed_versions.py fails on a request field that is in neither it nor its list of the fields
every executor reads).
"""
from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from typing import Callable, Iterable, Iterator

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from tandem import capabilities as caps
from tandem.executor.v1 import executor_pb2 as epb

_EXECUTOR = epb.DESCRIPTOR.services_by_name["ExecutorService"]
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]

# Calls that are a capability (an executor without it has no such method, or does nothing useful with it).
CALLS = {"CreateCache": caps.CREATE_CACHE, "SubscribeKvEvents": caps.KV_EVENTS, "ImportKv": caps.KV_TRANSFER,
         "ExportKv": caps.KV_TRANSFER, "ForwardVerify": caps.FORWARD_VERIFY, "TruncateCache": caps.TRUNCATE_CACHE,
         "OpenSession": caps.SESSIONS, "KeepAlive": caps.SESSIONS, "CloseSession": caps.SESSIONS}
# Calls a client may send without the capability listed: their UNIMPLEMENTED is the answer it falls back on (the
# scheduler: no session -> the anonymous one; no KV events -> routing on what it routed itself).
PROBES = frozenset({"OpenSession", "SubscribeKvEvents"})


# The request fields an executor without a capability would drop or misread, (message, field) -> (the capability,
# which values need it). A field set to another value, or not set, means what it meant before the capability.
FIELD_GATES: dict[tuple[str, str], tuple[str, Callable[[object], bool]]] = {
    ("UnifiedDecodeRequest", "release_cache_ids"): (caps.RELEASE_WITH_STEP, bool),
    ("DecodeRequest", "release_cache_ids"): (caps.RELEASE_WITH_STEP, bool),
    ("DecodeRequest", "num_steps"): (caps.MULTI_STEP_DECODE, lambda n: n > 1),
    ("UnifiedItem", "draft_token_ids"): (caps.SPECULATIVE_DRAFTS, bool),
    ("UnifiedItem", "allowed_tokens"): (caps.TOKEN_MASKS, bool),
    ("UnifiedItem", "prompt_logprobs"): (caps.PROMPT_LOGPROBS, lambda _: True),
    ("UnifiedItem", "pooling"): (caps.POOLING, lambda _: True),
    ("UnifiedItem", "model_draft_tokens"): (caps.DRAFT_MODEL, bool),
    ("UnifiedItem", "images"): (caps.VISION, bool),
    ("CreateCacheItem", "images"): (caps.VISION, bool),
    ("DecodeItem", "draft_token_ids"): (caps.SPECULATIVE_DRAFTS, bool),
    ("DecodeItem", "ngram_drafts"): (caps.MULTI_STEP_DRAFTS, lambda _: True),
    ("DecodeItem", "max_tokens"): (caps.MULTI_STEP_DRAFTS, bool),
    ("CreateCacheItem", "prompt_logprobs"): (caps.PROMPT_LOGPROBS, lambda _: True),
}


def fields_needing(message) -> Iterator[str]:
    """The capabilities the set fields of a request message (and of the messages in it) rely on."""
    name = message.DESCRIPTOR.name
    for field, value in message.ListFields():  # (the fields set: present, non-empty or not zero)
        gate = FIELD_GATES.get((name, field.name))
        if gate is not None and gate[1](value):
            yield gate[0]
        for m in (value,) if isinstance(value, Message) else value if field.message_type is not None else ():
            if isinstance(m, Message):  # (a map's entries iterate as keys: none of the contract's gates are in one)
                yield from fields_needing(m)
    if name == "UnifiedItem" and message.cache_id and message.is_final_chunk and not message.HasField("sampling"):
        yield caps.REGISTERED_SAMPLING  # (unset on an existing cache: the parameters registered with it)


_REQUESTS = {m.name: getattr(epb, m.input_type.name) for m in _EXECUTOR.methods}


class CapabilityProxy:
    """.address: where to point the client; .used: Counter of capabilities the client's requests relied on;
    .violations: what it sent that the capabilities it was shown do not allow; .probed: probes answered
    UNIMPLEMENTED; .calls: Counter of rpc names."""

    def __init__(self, upstream: str, hide: Iterable[str] = ()) -> None:
        self.upstream, self.hide = upstream, frozenset(hide)
        self.used: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.probed: Counter[str] = Counter()
        self.violations: list[str] = []
        self.shown: frozenset[str] | None = None  # the capabilities the last GetInfo answer listed
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(upstream, options=_OPTIONS)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="proxy"),
                                   handlers=[_Handler(self)], options=_OPTIONS)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def __enter__(self) -> "CapabilityProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def inspect(self, rpc: str, request: bytes) -> bool:
        """Records what the request relies on; False: answer UNIMPLEMENTED (a call this executor plays without)."""
        needed = {CALLS[rpc]} if rpc in CALLS else set()
        if rpc in _REQUESTS:
            needed.update(fields_needing(_REQUESTS[rpc].FromString(request)))
        with self._lock:
            self.calls[rpc] += 1
            self.used.update(needed)
            shown = self.shown if self.shown is not None else frozenset()
            missing = sorted(needed - shown)
            if missing and not (rpc in PROBES and set(missing) == {CALLS[rpc]}):
                self.violations.append(f"{rpc} relied on {missing}, which GetInfo did not list")
            if rpc in CALLS and CALLS[rpc] in self.hide:
                self.probed[rpc] += rpc in PROBES
                return False
        return True

    def shown_info(self, answer: bytes) -> bytes:
        info = epb.GetInfoResponse.FromString(answer)
        kept = [c for c in info.capabilities if c not in self.hide]
        del info.capabilities[:]
        info.capabilities.extend(kept)
        with self._lock:
            self.shown = frozenset(kept)
        return info.SerializeToString()


def _timeout(context: grpc.ServicerContext) -> float | None:
    """The call's time left (a call without a deadline reads as 0 here: then none)."""
    left = context.time_remaining()
    return left if 0 < left < 1e7 else None


def _forwarded_metadata(context: grpc.ServicerContext) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in context.invocation_metadata() if k != "user-agent" and not k.startswith(":")]


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: CapabilityProxy) -> None:
        self.proxy = proxy
        self.methods = {f"/{service.full_name}/{m.name}": (m.name, m.server_streaming)
                        for service in (_EXECUTOR, _HEALTH) for m in service.methods if not m.client_streaming}

    def service(self, details: grpc.HandlerCallDetails):
        if details.method not in self.methods:
            return None  # UNIMPLEMENTED
        rpc, streaming = self.methods[details.method]
        proxy, method = self.proxy, details.method

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            if not proxy.inspect(rpc, request):
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
            try:
                answer = proxy._channel.unary_unary(method)(request, timeout=_timeout(context),
                                                            metadata=_forwarded_metadata(context))
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")
            return proxy.shown_info(answer) if rpc == "GetInfo" else answer

        def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            if not proxy.inspect(rpc, request):
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
            call = proxy._channel.unary_stream(method)(request, timeout=_timeout(context),
                                                       metadata=_forwarded_metadata(context))
            context.add_callback(call.cancel)
            try:
                yield from call
            except grpc.RpcError as exc:
                if context.is_active():
                    context.abort(exc.code(), exc.details() or "")

        if streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)
