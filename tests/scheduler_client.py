"""Helpers for end-to-end tests of the scheduler: read a Generate stream into one result; wait for KV."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb


@dataclass
class Streamed:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    stop_reason: str = ""
    usage: pb.Usage | None = None
    messages: list[pb.GenerateResponse] = field(default_factory=list)


def collect(stub, request: pb.GenerateRequest, timeout: float = 120.0, metadata=None) -> Streamed:
    """Runs Generate to its end; checks the stream's shape (finish_reason and usage only on the last).
    metadata: the call's (a token)."""
    out = Streamed()
    for msg in stub.Generate(request, timeout=timeout, metadata=metadata):
        assert out.finish_reason == pb.FINISH_REASON_UNSPECIFIED, "a message arrived after the last one"
        out.messages.append(msg)
        out.text += msg.text
        out.token_ids += list(msg.token_ids)
        out.logprobs += list(msg.logprobs)
        assert len(msg.logprobs) == len(msg.token_ids)
        out.finish_reason = msg.finish_reason
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            out.stop_reason = msg.stop_reason
            out.usage = msg.usage
        else:
            assert not msg.HasField("usage"), "usage before the last message"
    assert out.finish_reason != pb.FINISH_REASON_UNSPECIFIED, "the stream ended without a finish_reason"
    return out


def ids_request(ids: list[int], max_new_tokens: int, **kw) -> pb.GenerateRequest:
    stopping = kw.pop("stopping", None) or pb.StoppingCriteria(max_new_tokens=max_new_tokens)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stopping=stopping, **kw)


def wait_kv_free(executor_stub, timeout: float = 15.0) -> epb.KvUsage:
    """Polls the executor until every KV block is free (releases are asynchronous to the client's view);
    fails with the last usage seen if that does not happen within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        kv = executor_stub.GetInfo(epb.GetInfoRequest()).kv
        if kv.free_blocks == kv.total_blocks and kv.active_caches == 0:
            return kv
        if time.monotonic() > deadline:
            raise AssertionError(f"KV not released within {timeout}s: {kv.free_blocks}/{kv.total_blocks} free, "
                                 f"{kv.active_caches} caches held")
        time.sleep(0.02)


def cancel_stream(call) -> None:
    """Cancels a Generate stream being read and checks that it ends CANCELLED."""
    call.cancel()
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED, exc
    else:
        raise AssertionError("a cancelled stream ended without an error")


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    try:
        result = fn(*args, **kw)
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)) and not hasattr(result, "ListFields"):
            for _ in result:  # a stream: the error comes while reading it
                pass
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded; an error status was expected")
