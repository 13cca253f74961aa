"""What the gRPC path costs apart from the model: its CPU pieces timed alone on real messages, the
interceptor's wrapper, and the round trip of an empty RPC."""
from __future__ import annotations

import statistics
import time

import grpc

from benchmarks.executor_sides import GrpcSide, InProcSide
from benchmarks.measure import median_seconds
from executor_service import codec
from executor_service.interceptor import ErrorMappingInterceptor, RpcMetrics
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc


def micro_breakdown(inproc: InProcSide, grpc_side: GrpcSide, repeats: int) -> dict[str, float]:
    """The gRPC path's CPU pieces, timed alone in this process on the last call's messages (ms):
    request serialise (client) / parse (server), codec request -> domain, the servicer's response
    building (codec domain -> proto, logits encoding included) from the in-process side's results of the
    same shape, response serialise (server) / parse (client)."""
    req, resp = grpc_side.last_request, grpc_side.last_response
    results = inproc.last_results
    req_bytes, resp_bytes = req.SerializeToString(), resp.SerializeToString()
    items = [codec.decode_item_from_pb(i) for i in req.items]
    ex = inproc.ex

    def build_response() -> pb.DecodeResponse:  # what ExecutorServicer.Decode does after the executor call
        return codec.decode_response_to_pb(results, [dtype for _, dtype in items], ex.kv_usage())

    parts = {
        "req_serialize": lambda: req.SerializeToString(),
        "req_parse": lambda: pb.DecodeRequest.FromString(req_bytes),
        "codec_in": lambda: [codec.decode_item_from_pb(i) for i in req.items],
        "codec_out": build_response,
        "resp_serialize": lambda: resp.SerializeToString(),
        "resp_parse": lambda: pb.DecodeResponse.FromString(resp_bytes),
    }
    out = {k: 1e3 * median_seconds(fn, repeats) for k, fn in parts.items()}
    out["total"] = sum(out.values())
    return out


def interceptor_overhead_ms(repeats: int = 2000) -> float:
    """Extra ms per call of ErrorMappingInterceptor's wrapper around a no-op unary handler."""
    def noop(request, context):
        return None

    details = type("Details", (), {"method": "/tandem.executor.v1.ExecutorService/Decode",
                                   "invocation_metadata": ()})()
    wrapped = ErrorMappingInterceptor(RpcMetrics()).intercept_service(
        lambda _: grpc.unary_unary_rpc_method_handler(noop), details).unary_unary
    best = []
    for fn in (noop, wrapped):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn(None, None)
            runs.append((time.perf_counter() - t0) / repeats)
        best.append(min(runs))
    return 1e3 * (best[1] - best[0])


def empty_rpc_ms(stub: pb_grpc.ExecutorServiceStub, n: int) -> dict[str, float]:
    """Round trip of ReleaseCache with no ids: channel + gRPC + interceptor + a trivial handler."""
    req = pb.ReleaseCacheRequest()
    for _ in range(min(10, n)):
        stub.ReleaseCache(req)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        stub.ReleaseCache(req)
        times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "calls": n}
