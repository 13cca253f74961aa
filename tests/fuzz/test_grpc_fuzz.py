"""Property-based fuzzing of both gRPC services against real processes: a tiny llama executor (with an
adapter root) and a scheduler with default flags. Hypothesis draws

- valid-shaped request messages of every unary ExecutorService RPC and of GenerateService's Generate and
  Tokenize, built field by field from the message descriptors: integers at and past every wire range, floats
  that are inf, NaN or denormal, odd Unicode (NUL, bidi marks, the last code point, long strings), empty and
  oversized repeated fields, unknown enum values, unknown or real cache ids, random session ids;
- byte-level garbage for every method of both services: random bytes, a valid message cut short, a valid
  message of another type.

The properties: every call ends OK or with a precise status (INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE,
FAILED_PRECONDITION, RESOURCE_EXHAUSTED, PERMISSION_DENIED; UNAVAILABLE too for ImportKv, whose source may not be
there), never UNKNOWN, INTERNAL or a cancel; the server
answers the next normal request; and at the end every KV block is free with no cache left (the executor's
examples release whatever caches a call legitimately created: what stays held after that is a leak).

Examples per property: tests/fuzz/conftest.py (`--fuzz-examples N` for a long run).
"""
from __future__ import annotations

import uuid

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as gpb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import wait_kv_free

PRECISE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.PERMISSION_DENIED}
# ImportKv dials the source_address it is given: a loopback address where nothing listens is UNAVAILABLE, the
# precise code for "the source cannot be reached" (docs/kv-transfer.md); no other method may answer it.
PRECISE_FOR = {"ImportKv": PRECISE | {grpc.StatusCode.UNAVAILABLE}}
# Addresses ImportKv may be sent: nothing listening on loopback, off loopback without TLS (refused), malformed.
SOURCE_ADDRESSES = ["127.0.0.1:9", "localhost:1", "[::1]:2", "10.1.2.3:50051", "127.0.0.1:0", "127.0.0.1:65536",
                    ":50051", "127.0.0.1", "[::1]"]
EXECUTOR = epb.DESCRIPTOR.services_by_name["ExecutorService"]
GENERATE = gpb.DESCRIPTOR.services_by_name["GenerateService"]
# Unary executor RPCs (SubscribeKvEvents is a stream that stays open by design: tests/e2e covers its garbage).
EXECUTOR_UNARY = [m for m in EXECUTOR.methods if not m.server_streaming]
REAL_CACHE = "<a real cache id>"  # replaced, at call time, by the id of a cache made for the example

_U32 = [0, 1, 2, 255, 2**31 - 1, 2**31, 2**32 - 1]
_I64 = [-(2**63), -1, 0, 1, 2**31, 2**53 + 1, 2**63 - 1]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 2.0]
ODD_TEXT = st.sampled_from(["", "\x00", "a\x00b", "\u202e\u200b\ufeff", "\U0010ffff", "🙂" * 40, "\r\n", "x" * 5000,
                            "../../etc/passwd", "/", ".", "null", "{}", "<|endoftext|>", "\\x00"]) \
    | st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=16)  # protobuf refuses lone surrogates
TOKEN = st.integers(min_value=0, max_value=447)  # the tiny model's vocabulary


def _scalar(field) -> st.SearchStrategy:
    t, name = field.type, field.name
    if t == F.TYPE_STRING:
        if "cache_id" in name:
            return st.sampled_from([REAL_CACHE, REAL_CACHE, "", uuid.uuid4().hex]) | ODD_TEXT
        if "session_id" in name:
            return st.sampled_from(["", uuid.uuid4().hex]) | ODD_TEXT
        if name == "source_address":
            return st.sampled_from(SOURCE_ADDRESSES) | ODD_TEXT
        return ODD_TEXT
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.sampled_from(_FLOATS) | st.floats(width=32)
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [7, 2**31 - 1, -1])
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        small = TOKEN if "id" in name or "token" in name else st.integers(0, 40)
        return small | small | st.sampled_from(_U32)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 40) | st.sampled_from([0, 2**32, 2**64 - 1])
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(-3, 40) | st.sampled_from([-(2**31), 2**31 - 1])
    return st.integers(-3, 40) | st.sampled_from(_I64)


def _is_map(field) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _field(field, depth: int) -> st.SearchStrategy:
    if _is_map(field):  # e.g. logit biases: token id -> bias
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_field(key, depth), _field(value, depth + 1), max_size=4)
    one = st.deferred(lambda: message(field.message_type, depth + 1)) if field.type == F.TYPE_MESSAGE \
        else _scalar(field)
    if not field.is_repeated:
        return one
    if field.type != F.TYPE_MESSAGE and field.type not in (F.TYPE_STRING, F.TYPE_BYTES):
        oversized = st.lists(one, min_size=300, max_size=300) if "id" in field.name else st.nothing()
        return st.lists(one, max_size=6) | oversized  # e.g. 300 token ids: more than the model's 256 positions
    return st.lists(one, max_size=3 if depth < 2 else 1)


@st.composite
def _build(draw, descriptor, depth: int):
    msg = _class(descriptor)()
    for field in descriptor.fields:
        if depth > 3 and field.type == F.TYPE_MESSAGE:
            continue
        if not draw(st.booleans()):
            continue
        value = draw(_field(field, depth))
        try:
            if _is_map(field):
                for k, v in value.items():
                    if field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                        getattr(msg, field.name)[k].CopyFrom(v)
                    else:
                        getattr(msg, field.name)[k] = v
            elif field.is_repeated:
                getattr(msg, field.name).extend(value)
            elif field.type == F.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(value)
            else:
                setattr(msg, field.name, value)
        except (ValueError, TypeError):  # a value this field's Python type refuses: the wire never sees it
            pass
    return msg


def message(descriptor, depth: int = 0) -> st.SearchStrategy:
    return _build(descriptor, depth)


def _class(descriptor):
    module = epb if descriptor.full_name.startswith("tandem.executor.") else gpb
    if descriptor.file.package == "tandem.common.v1":
        from tandem.common.v1 import common_pb2 as module
    cls = getattr(module, descriptor.name, None)
    if cls is None or cls.DESCRIPTOR is not descriptor:  # a nested type
        from google.protobuf import message_factory
        cls = message_factory.GetMessageClass(descriptor)
    return cls


def garbage(descriptor) -> st.SearchStrategy:
    """Bytes for a method taking `descriptor`: random, a valid message cut short, another type's message."""
    others = [m.input_type for m in list(EXECUTOR.methods) + list(GENERATE.methods) if m.input_type != descriptor]
    cut = message(descriptor).map(lambda m: m.SerializeToString()).flatmap(
        lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n] + b"\xff"))
    other = st.sampled_from(others).flatmap(lambda d: message(d)).map(lambda m: m.SerializeToString())
    return st.binary(max_size=256) | cut | other


def _settings(fuzz_examples: tuple[int, bool], share: float = 1.0) -> settings:
    examples, derandomize = fuzz_examples
    return settings(max_examples=max(1, int(examples * share)), deadline=None, derandomize=derandomize,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=True)


def _outcome(call, what, precise: set[grpc.StatusCode] = PRECISE) -> grpc.StatusCode:
    """Runs a call (a stream is read to its end) and returns its status, failing on one not in precise."""
    try:
        result = call()
        if hasattr(result, "__next__"):
            for _ in result:
                pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in precise, (code, exc.details(), what)
        assert "Traceback" not in (exc.details() or "") and "<class" not in (exc.details() or ""), exc.details()
    event(code.name)  # --hypothesis-show-statistics shows the mix
    return code


@pytest.fixture(scope="module")
def executor(request, model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    (root / "empty").mkdir()
    return start_for(request, model_dir, "--kv-blocks", "128", "--adapter-root", str(root), "--decode-kernel",
                     "torch")


@pytest.fixture(scope="module")
def scheduler(request, executor):
    return start_scheduler_for(request, executor.address)


def _release_everything(stub) -> None:
    """Every cache the examples made (any session but the scheduler's, the anonymous one included) is released."""
    for s in stub.ListCaches(epb.ListCachesRequest(), timeout=30).sessions:
        if s.client_name.startswith("tandem-scheduler"):
            continue
        ids = [c.cache_id for c in s.caches]
        if ids:
            stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=ids, session_id=s.session_id), timeout=30)


def _with_real_caches(stub, msg) -> None:
    """Replaces REAL_CACHE markers (at any depth) by the id of a fresh 5-token cache."""
    real = None
    for field, value in msg.ListFields():
        if field.type == F.TYPE_MESSAGE and not _is_map(field):
            for sub in (value if field.is_repeated else [value]):
                _with_real_caches(stub, sub)
        elif field.type == F.TYPE_STRING and "cache_id" in field.name:
            values = list(value) if field.is_repeated else [value]
            if REAL_CACHE in values:
                real = real or stub.Prefill(epb.PrefillRequest(token_ids=[1, 2, 3, 4, 5]), timeout=30).cache.cache_id
                fixed = [real if v == REAL_CACHE else v for v in values]
                if field.is_repeated:
                    del getattr(msg, field.name)[:]
                    getattr(msg, field.name).extend(fixed)
                else:
                    setattr(msg, field.name, fixed[0])


def test_executor_requests(executor, fuzz_examples):
    stub = executor.stub
    calls = {m.name: getattr(stub, m.name) for m in EXECUTOR_UNARY}

    @_settings(fuzz_examples, share=2)
    @given(st.sampled_from(EXECUTOR_UNARY).flatmap(lambda m: st.tuples(st.just(m.name), message(m.input_type))))
    def check(drawn):
        name, msg = drawn
        _with_real_caches(stub, msg)
        _outcome(lambda: calls[name](msg, timeout=60), (name, msg), PRECISE_FOR.get(name, PRECISE))
        stub.GetInfo(epb.GetInfoRequest(), timeout=30)  # the next normal request
        _release_everything(stub)

    check()
    wait_kv_free(stub)


def test_import_kv_requests(executor, fuzz_examples):
    """ImportKv alone (its share of the mix above is small): source addresses that are malformed, off loopback
    (refused without TLS), or on loopback with nothing listening (UNAVAILABLE); nothing is ever kept."""
    stub = executor.stub
    method = EXECUTOR.methods_by_name["ImportKv"]

    @_settings(fuzz_examples, share=0.5)
    @given(message(method.input_type))
    def check(msg):
        _with_real_caches(stub, msg)
        _outcome(lambda: stub.ImportKv(msg, timeout=60), ("ImportKv", msg), PRECISE_FOR["ImportKv"])
        stub.GetInfo(epb.GetInfoRequest(), timeout=30)
        _release_everything(stub)

    check()
    wait_kv_free(stub)


def test_generate_requests(scheduler, executor, fuzz_examples):
    stub = scheduler.stub

    @_settings(fuzz_examples)
    @given(message(GENERATE.methods_by_name["Generate"].input_type),
           st.none() | st.integers(0, 24) | st.sampled_from(_U32), st.booleans())
    def check(request, max_new, cancel_early):
        if max_new is not None:  # most examples short: the tiny model's 256 positions bound the rest
            request.stopping.max_new_tokens = max_new
        if cancel_early:  # a client that goes away after the first message must leave nothing behind either
            call = stub.Generate(request, timeout=120)
            try:
                next(call, None)
            except grpc.RpcError as exc:
                assert exc.code() in PRECISE, (exc.code(), exc.details(), request)
            call.cancel()
        else:
            _outcome(lambda: stub.Generate(request, timeout=120), request)
        stub.Tokenize(gpb.TokenizeRequest(text="hello"), timeout=30)

    check()
    wait_kv_free(executor.stub)
    assert not any(s.caches for s in executor.stub.ListCaches(epb.ListCachesRequest()).sessions)


def test_tokenize_requests(scheduler, fuzz_examples):
    stub = scheduler.stub

    @_settings(fuzz_examples, share=0.5)
    @given(message(GENERATE.methods_by_name["Tokenize"].input_type))
    def check(request):
        _outcome(lambda: stub.Tokenize(request, timeout=60), request)

    check()
    stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)


def test_garbage_bytes(scheduler, executor, fuzz_examples):
    """Raw bytes to every method of both services (the channel sends them as they are: no serializer)."""
    targets = [(scheduler, f"/{GENERATE.full_name}/{m.name}", m) for m in GENERATE.methods] + \
              [(executor, f"/{EXECUTOR.full_name}/{m.name}", m) for m in EXECUTOR_UNARY]

    @_settings(fuzz_examples, share=2)
    @given(st.sampled_from(targets).flatmap(lambda t: st.tuples(st.just(t), garbage(t[2].input_type))))
    def check(drawn):
        (server, path, method), data = drawn
        call = server.channel.unary_stream(path) if method.server_streaming else server.channel.unary_unary(path)
        _outcome(lambda: call(data, timeout=120), (path, data))
        _release_everything(executor.stub)

    check()
    scheduler.stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
    wait_kv_free(executor.stub)
