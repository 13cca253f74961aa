"""The one place that turns domain errors into gRPC status codes (AIP-193: the most specific code)."""
from __future__ import annotations

import grpc

from models.errors import (AdapterNotFound, CacheNotFound, CacheStateConflict, CheckpointError, InvalidRequest,
                           KvCapacityExceeded, PositionMismatch, SequenceTooLong, TandemError, Unavailable)

STATUS_OF: dict[type[TandemError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    CacheNotFound: grpc.StatusCode.NOT_FOUND,
    AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    PositionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CacheStateConflict: grpc.StatusCode.FAILED_PRECONDITION,
    SequenceTooLong: grpc.StatusCode.OUT_OF_RANGE,
    KvCapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CheckpointError: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: TandemError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL
