"""Domain errors raised by the model core, the in-process executor and the scheduler.

Each class names one failure a caller can act on. The gRPC edge maps them to status codes in a single
table (tandem/status_map.py); nothing here knows about gRPC.
"""
from __future__ import annotations


class TandemError(Exception):
    """Base class of every error a caller can provoke (bad input, wrong state, no capacity).

    field: the request field at fault, as a proto field path (`sampling.top_p`, `stopping.stop[2]`,
    `messages.messages[1].content`), or None. The message may write it as `{field}`: str() fills in the path
    (what a gRPC client reads), in_terms() another name (the HTTP front's OpenAI parameter,
    scheduler/http/errors.py); a message that does not write it is prefixed with it."""

    def __init__(self, message: str = "", field: str | None = None) -> None:
        self.field = field
        self.template = message if field is None or "{field}" in message else "{field}: " + message
        super().__init__(self.in_terms(field) if field is not None else message)

    def in_terms(self, name: str) -> str:
        """The message with the field called `name`."""
        return self.template.replace("{field}", name)


class InvalidRequest(TandemError):
    """The request is wrong whatever the server's state (bad token id, empty input, bad sampling value)."""


class CacheNotFound(TandemError):
    """A cache id that the executor does not hold (never created, or already released)."""

    def __init__(self, cache_id: str) -> None:
        super().__init__(f"unknown cache id {cache_id!r}: it was never created or has been released (a cache "
                         "is visible only to its own session, and goes when that session closes or its lease lapses)")
        self.cache_id = cache_id


class SessionNotFound(TandemError):
    """A session id the executor does not hold (never opened, closed, or reaped after its lease lapsed)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is unknown or expired; open a new one (OpenSession): the caches "
                         "of an expired session are gone")
        self.session_id = session_id


class PositionMismatch(TandemError):
    """A request addressed a cache at a position other than its current length."""


class CacheStateConflict(TandemError):
    """The operation does not fit the cache's state (e.g. continuing the prompt of a cache already decoding)."""


class SequenceTooLong(TandemError):
    """The sequence would grow past the model's maximum length (max_position_embeddings)."""


class CapacityExceeded(TandemError):
    """Not enough capacity for the request now (queue full) or ever (it alone cannot fit the KV cache)."""


class KvCapacityExceeded(CapacityExceeded):
    """Not enough free KV blocks for the request; nothing was allocated."""

    def __init__(self, needed_blocks: int, free_blocks: int, total_blocks: int) -> None:
        super().__init__(
            f"KV cache full: the request needs {needed_blocks} more blocks but only {free_blocks} of "
            f"{total_blocks} are free; release finished caches or retry later"
        )
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        self.total_blocks = total_blocks


class Overloaded(CapacityExceeded):
    """More work than the server can start in time: its queue is full, the wait it measures for a new request is
    past the queue-time bound, a queued request reached that bound before its first step, or the calls it
    serves at once are at their limit. Nothing of the request ran. retry_after_s: when a retry is likely to be
    taken (whole seconds, >= 1; from the measured drain rate where there is one); reason: a short label
    (the refusals counter's, e.g. "queue_full")."""

    def __init__(self, message: str, retry_after_s: int = 1, reason: str = "overloaded") -> None:
        super().__init__(message)
        self.retry_after_s = max(1, int(retry_after_s))
        self.reason = reason


class QueueFull(CapacityExceeded):
    """Too many calls are already waiting for the model; nothing was done. Retry later."""


class Unavailable(TandemError):
    """The executor cannot serve right now (still loading, or shutting down); retry later or elsewhere."""


class CheckpointError(TandemError):
    """A model directory that cannot be loaded (unknown architecture, missing file or tensor, bad shape)."""


class AdapterNotFound(TandemError):
    """A request named an adapter the executor does not hold."""


class Unsupported(TandemError):
    """The request needs something this model or server does not have (e.g. chat messages without a chat
    template)."""


class ResponseNotFound(TandemError):
    """A stored response id (the OpenAI front's previous_response_id) that this server does not hold: never
    stored, stored with store false, or dropped from its bounded store."""


class NotServed(TandemError):
    """A method of a protocol Tandem speaks that does something Tandem does not do (embeddings, say); the
    message names what. Answered UNIMPLEMENTED."""


class RemoteError(TandemError):
    """An error status another Tandem service returned (the executor, seen by the scheduler); relayed with
    the same code and the remote message."""

    def __init__(self, status_name: str, message: str) -> None:
        super().__init__(message)
        self.status_name = status_name  # a grpc.StatusCode name, e.g. "INVALID_ARGUMENT"


class PermissionDenied(TandemError):
    """The request reaches outside what this server may touch (an adapter path outside --adapter-root), or
    outside what the caller's token may do (an admin RPC with a user token)."""


class Unauthenticated(TandemError):
    """The server checks tokens and the call carried none, or one it does not know."""


class AdapterInUse(TandemError):
    """The adapter's state forbids the operation: its name is already loaded, or caches still use it."""


class TokenLimitExceeded(CapacityExceeded):
    """One token is over its own share (--max-concurrent-per-token, --max-queued-tokens-per-token); other
    tokens' calls are not affected. Retry when some of this token's requests have finished."""


class DeviceOutOfMemory(CapacityExceeded):
    """The device ran out of memory during a model call (CUDA OOM); the call changed nothing. A smaller batch
    (fewer items or tokens) or a lower --max-attention-elements fits; retrying the same call may fail again."""


class ReplyTooLarge(CapacityExceeded):
    """The reply a call would produce is over the server's message size limit; refused before running."""


class StreamStalled(CapacityExceeded):
    """The client stopped reading its stream (or fell too far behind): the request was stopped, its KV freed."""


class DeadlineExceeded(TandemError):
    """The caller's deadline had passed before the call could run; it was not run (nothing changed)."""


class TooManyCalls(Overloaded):
    """The server is already serving as many calls as its limit allows (--max-concurrent-rpcs); the call was
    refused on arrival, before any work. Retry later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s, "rpc_limit")


class DataLoss(TandemError):
    """Data that arrived (or was read back) corrupted or incomplete: a KV block whose checksum does not match,
    a transfer stream that ended short (executor_service/kv/transfer/pinned_export.py)."""


class BlocksNotCached(TandemError):
    """An ExportKv of a chain of block hashes none of which the executor holds (evicted, or never computed)."""
