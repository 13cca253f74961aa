"""The one place that turns domain errors into gRPC status codes (AIP-193: the most specific code), for both
servers: the executor and the scheduler."""
from __future__ import annotations

import grpc

from tandem.errors import (AdapterInUse, AdapterNotFound, BlocksNotCached, CacheNotFound, CacheStateConflict, CapacityExceeded,
                           CheckpointError, DataLoss, DeadlineExceeded, InvalidRequest, NotServed, PermissionDenied,
                           PositionMismatch, RemoteError, ResponseNotFound, SequenceTooLong, SessionNotFound, TandemError,
                           Unauthenticated, Unavailable, Unsupported)

STATUS_OF: dict[type[TandemError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    CacheNotFound: grpc.StatusCode.NOT_FOUND,
    AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    ResponseNotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    AdapterInUse: grpc.StatusCode.FAILED_PRECONDITION,
    PositionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CacheStateConflict: grpc.StatusCode.FAILED_PRECONDITION,
    SequenceTooLong: grpc.StatusCode.OUT_OF_RANGE,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unsupported: grpc.StatusCode.FAILED_PRECONDITION,
    CheckpointError: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    NotServed: grpc.StatusCode.UNIMPLEMENTED,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    BlocksNotCached: grpc.StatusCode.NOT_FOUND,
}


def status_for(exc: TandemError) -> grpc.StatusCode:
    if isinstance(exc, RemoteError):  # relayed as the remote service chose it
        return getattr(grpc.StatusCode, exc.status_name, grpc.StatusCode.UNKNOWN)
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL
