"""LoRA adapters: bad adapter directories, paths outside --adapter-root, wrong names and wrong
state raise typed errors with the right gRPC code, leave the executor exactly as it was (adapter list,
counters, KV) and it keeps serving. Plus the same codes over a real gRPC server."""
from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from executor_service.rpc import codec
from tandem.status_map import status_for
from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tandem.errors import AdapterNotFound, CacheStateConflict, InvalidRequest, PermissionDenied, TandemError
from tandem.executor.v1 import executor_pb2 as pb
from tests.executor_driver import LOGITS, make_executor, raising
from tests.grpc_harness import start_for
from tests.lora_fixtures import (ALL_MODULES, HfReference, PeftReference, edit_adapter_config, edit_adapter_tensors,
                                 make_peft_adapter, rel_err)

Code = grpc.StatusCode
MAX_RANK = 16
PROMPT = [5, 6, 7, 8, 9, 10]


class Env:
    """base: tiny llama; root: the adapter root; good: a valid adapter inside it (r=4, q/v); other: a second
    valid one (r=8, all modules); outside: a valid adapter outside the root."""

    def __init__(self, base: Path, root: Path, outside_dir: Path) -> None:
        self.base, self.root = base, root
        self.good = make_peft_adapter(base, root / "good", r=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=1)
        self.other = make_peft_adapter(base, root / "other", r=8, alpha=16, target_modules=ALL_MODULES, seed=2)
        self.outside = make_peft_adapter(base, outside_dir / "adapter", r=4, alpha=8, target_modules=("q_proj",),
                                         seed=3)
        self._n = 0

    def copy_good(self, label: str) -> Path:
        """A fresh copy of the good adapter inside the root, to be broken by a test."""
        self._n += 1
        dst = self.root / f"{label}-{self._n}"
        shutil.copytree(self.good, dst)
        return dst


@pytest.fixture(scope="module")
def env(tiny_checkpoint, tmp_path_factory) -> Env:
    return Env(tiny_checkpoint("llama"), tmp_path_factory.mktemp("lora-root"), tmp_path_factory.mktemp("outside"))


@pytest.fixture()
def ex(env):
    """An executor with adapter "a" (env.good) preloaded and runtime loading from env.root."""
    return make_executor(env.base, kv_blocks=12, adapter_root=env.root, adapters=(("a", env.good),),
                         max_lora_rank=MAX_RANK)


def snapshot(ex) -> tuple:
    return sorted(ex.list_adapters(), key=lambda a: a.name), ex.kv_usage()


def still_serves(ex) -> None:
    """A base prefill and one on adapter "a" (when loaded) work, and release cleanly."""
    kv = ex.kv_usage()
    names = [""] + [a.name for a in ex.list_adapters()][:1]
    for name in names:
        res = ex.prefill(PROMPT, adapter=name)
        assert res.cache.seq_len == len(PROMPT)
        ex.release_cache([res.cache.cache_id])
    assert ex.kv_usage() == kv


@contextmanager
def rejected(ex, code: grpc.StatusCode | tuple, cls: type | tuple = TandemError, match: str | None = None):
    """The block must raise a TandemError of `cls` whose gRPC code is `code` (or one of them; message
    matching `match`), change nothing the executor reports, and leave it serving."""
    codes = code if isinstance(code, tuple) else (code,)
    before = snapshot(ex)
    with pytest.raises(TandemError) as err:
        yield err
    assert isinstance(err.value, cls), f"{type(err.value).__name__}: {err.value}"
    assert status_for(err.value) in codes, f"{type(err.value).__name__} maps to {status_for(err.value)}, not {code}"
    if match:
        assert re.search(match, str(err.value)), f"message {str(err.value)!r} does not match {match!r}"
    after = snapshot(ex)
    assert after == before, f"state changed by a rejected call:\n{before}\n->\n{after}"
    still_serves(ex)


def kv_all_free(ex) -> bool:
    u = ex.kv_usage()
    return u.free_blocks == u.total_blocks and u.active_caches == 0


# ---------------------------------------------------------------------------------------- request time
def test_unknown_adapter_on_requests(ex):
    with rejected(ex, Code.NOT_FOUND, AdapterNotFound, "nope"):
        ex.prefill(PROMPT, adapter="nope")
    assert kv_all_free(ex)
    with rejected(ex, Code.NOT_FOUND, AdapterNotFound):
        raising(ex.unified_decode([UnifiedItem(tuple(PROMPT[:3]), is_final_chunk=False, adapter="A")]))  # exact
    assert kv_all_free(ex)
    # Beside good items the unknown one fails alone (the item status), and the base and "a" items run.
    served = {a.name: a.requests for a in ex.list_adapters()}["a"]
    base, on_a, unknown = ex.unified_decode([UnifiedItem(tuple(PROMPT)), UnifiedItem(tuple(PROMPT), adapter="a"),
                                             UnifiedItem((3, 4), adapter="nope")])
    assert isinstance(unknown.error, AdapterNotFound) and "item 2" in str(unknown.error)
    assert unknown.cache.cache_id == "" and unknown.output is None
    assert base.error is None and on_a.error is None and ex.kv_usage().active_caches == 2
    assert {a.name: a.requests for a in ex.list_adapters()} == {"a": served + 1}
    ex.release_cache([base.cache.cache_id, on_a.cache.cache_id])
    assert kv_all_free(ex)


def test_unknown_adapter_on_existing_cache(ex):
    res = ex.prefill(PROMPT, adapter="a")
    cid, tok = res.cache.cache_id, res.output.tokens[0].token_id
    # Unknown name and a name differing from the cache's: either NOT_FOUND or FAILED_PRECONDITION is fine.
    with rejected(ex, (Code.NOT_FOUND, Code.FAILED_PRECONDITION)):
        raising(ex.decode([DecodeItem(CacheRef(cid, len(PROMPT)), tok, adapter="nope")]))
    assert ex.cache_length(cid) == len(PROMPT)
    (d,) = ex.decode([DecodeItem(CacheRef(cid, len(PROMPT)), tok, adapter="a")])
    assert d.cache.seq_len == len(PROMPT) + 1
    ex.release_cache([cid])
    assert kv_all_free(ex)


def test_kv_full_with_adapter_changes_nothing(env):
    """A forward refused for KV capacity (the error comes from the run, after validation) must not count
    adapter requests or move adapters in or out of the device either."""
    ex = make_executor(env.base, kv_blocks=4, adapter_root=env.root, max_adapters_on_device=1,
                       adapters=(("a", env.good), ("b", env.other)))
    held = ex.prefill(PROMPT, adapter="a")  # "a" on the device, 1 block
    with rejected(ex, Code.RESOURCE_EXHAUSTED):
        ex.prefill([3] * 64, adapter="b")  # 4 blocks needed, 3 free
    with rejected(ex, Code.RESOURCE_EXHAUSTED):
        ex.unified_decode([UnifiedItem((held.output.tokens[0].token_id,), held.cache.cache_id, len(PROMPT),
                                       adapter="a"), UnifiedItem((3,) * 60, adapter="a")])
    ex.release_cache([held.cache.cache_id])
    assert kv_all_free(ex)


def test_cache_keeps_its_adapter(ex, env):
    """A cache's adapter is fixed at creation: continuing it with another adapter (or the base model), by
    decode, unified item or a chunked prefill, is FAILED_PRECONDITION and changes nothing."""
    ex.load_adapter("b", env.other)
    a = ex.prefill(PROMPT, adapter="a")
    a_id, a_tok = a.cache.cache_id, a.output.tokens[0].token_id
    base = ex.prefill(PROMPT)
    base_id, base_tok = base.cache.cache_id, base.output.tokens[0].token_id
    (chunk,) = ex.unified_decode([UnifiedItem(tuple(PROMPT), is_final_chunk=False, adapter="a")])
    chunk_id = chunk.cache.cache_id
    n = len(PROMPT)
    cases = [  # batch calls fail per item (raising: that item's error)
        lambda: raising(ex.decode([DecodeItem(CacheRef(a_id, n), a_tok, adapter="b")])),
        lambda: raising(ex.decode([DecodeItem(CacheRef(a_id, n), a_tok)])),  # the base model
        lambda: raising(ex.decode([DecodeItem(CacheRef(base_id, n), base_tok, adapter="a")])),
        lambda: raising(ex.unified_decode([UnifiedItem((a_tok,), a_id, n, adapter="b")])),
        lambda: raising(ex.unified_decode([UnifiedItem((a_tok,), a_id, n, adapter="")])),
        lambda: ex.prefill([3, 4], cache_id=chunk_id, adapter="b"),
        lambda: ex.forward_verify(CacheRef(a_id, n), [a_tok, 3], adapter="b"),
        lambda: ex.forward_verify(CacheRef(base_id, n), [base_tok, 3], adapter="a"),
        lambda: raising(ex.unified_decode([UnifiedItem((3, 4), chunk_id, n, adapter="")])),
    ]
    for i, call in enumerate(cases):
        with rejected(ex, Code.FAILED_PRECONDITION):
            call()
        assert [ex.cache_length(c) for c in (a_id, base_id, chunk_id)] == [n, n, n], f"case {i}"
    # The right adapter still continues each of them.
    ex.unified_decode([UnifiedItem((a_tok,), a_id, n, adapter="a"), UnifiedItem((base_tok,), base_id, n),
                       UnifiedItem((3, 4), chunk_id, n, adapter="a")])
    assert [ex.cache_length(c) for c in (a_id, base_id, chunk_id)] == [n + 1, n + 1, n + 2]
    ex.release_cache([a_id, base_id, chunk_id])
    assert kv_all_free(ex)


def test_conflict_error_class(ex, env):
    """The issue names CacheStateConflict for a cache continued with another adapter."""
    ex.load_adapter("b", env.other)
    a = ex.prefill(PROMPT, adapter="a")
    (d,) = ex.decode([DecodeItem(CacheRef(a.cache.cache_id, len(PROMPT)), a.output.tokens[0].token_id,
                                 adapter="b")])
    assert isinstance(d.error, CacheStateConflict)
    ex.release_cache([a.cache.cache_id])


# ---------------------------------------------------------------------------------------- unload
def test_unload_while_in_use(ex):
    res = ex.prefill(PROMPT, adapter="a")
    (chunk,) = ex.unified_decode([UnifiedItem(tuple(PROMPT), is_final_chunk=False, adapter="a")])
    assert {a.name: a.active_caches for a in ex.list_adapters()} == {"a": 2}
    with rejected(ex, Code.FAILED_PRECONDITION, match="a"):
        ex.unload_adapter("a")
    ex.release_cache([res.cache.cache_id])
    with rejected(ex, Code.FAILED_PRECONDITION):  # a cache still mid-prompt counts too
        ex.unload_adapter("a")
    ex.release_cache([chunk.cache.cache_id])
    ex.unload_adapter("a")
    assert ex.list_adapters() == [] and ex.info().adapters == ()
    with rejected(ex, Code.NOT_FOUND, AdapterNotFound):
        ex.prefill(PROMPT, adapter="a")
    assert kv_all_free(ex)


def test_unload_unknown(ex):
    with rejected(ex, Code.NOT_FOUND, AdapterNotFound, "nope"):
        ex.unload_adapter("nope")
    with rejected(ex, Code.NOT_FOUND, AdapterNotFound):
        ex.unload_adapter("")


# ---------------------------------------------------------------------------------------- load: names, paths
def test_duplicate_name(ex, env):
    with rejected(ex, Code.FAILED_PRECONDITION, match="a"):
        ex.load_adapter("a", env.good)
    with rejected(ex, Code.FAILED_PRECONDITION):  # another directory under a taken name
        ex.load_adapter("a", env.other)
    # The same directory under a new name is fine.
    assert ex.load_adapter("a2", env.good).name == "a2"


@pytest.mark.parametrize("name", ["", "has space", "a/b", "../a", "x" * 65, "naïve", "a\n"])
def test_bad_names(ex, env, name):
    with rejected(ex, Code.INVALID_ARGUMENT, InvalidRequest):
        ex.load_adapter(name, env.other)


def test_good_names_and_relative_path(ex, env):
    for name in ("B-2", "x" * 64, "v1.0_final"):
        info = ex.load_adapter(name, "other")  # relative to the adapter root
        assert Path(info.path).resolve() == env.other.resolve()
        ex.unload_adapter(name)
    assert [a.name for a in ex.list_adapters()] == ["a"]


def _outside_dotdot(env: Env) -> str:
    rel = Path("..") / env.outside.parent.name / env.outside.name
    return str(env.root / rel)


PATH_CASES = {
    "absolute-outside": lambda env: str(env.outside),
    "dotdot-absolute": _outside_dotdot,
    "dotdot-relative": lambda env: str(Path("..") / env.outside.parent.name / env.outside.name),
    "dotdot-inside-then-out": lambda env: str(env.root / "good" / ".." / ".." / env.outside.parent.name
                                              / env.outside.name),
    "root-itself-parent": lambda env: str(env.root.parent),
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_path_outside_root(ex, env, case):
    with rejected(ex, Code.PERMISSION_DENIED, PermissionDenied):
        ex.load_adapter("x", PATH_CASES[case](env))


def test_symlink_out_of_root(ex, env):
    link = env.root / "link-out"
    if not link.exists():
        link.symlink_to(env.outside, target_is_directory=True)
    with rejected(ex, Code.PERMISSION_DENIED, PermissionDenied):
        ex.load_adapter("x", link)
    with rejected(ex, Code.PERMISSION_DENIED, PermissionDenied):
        ex.load_adapter("x", "link-out")
    # A link whose target stays inside the root is fine.
    inner = env.root / "link-in"
    if not inner.exists():
        inner.symlink_to(env.good, target_is_directory=True)
    assert ex.load_adapter("x", inner).rank == 4


def test_file_symlinked_out_of_root(ex, env):
    """The directory is inside the root but its weights file links outside: the executor would read a file
    outside the root, so PERMISSION_DENIED too."""
    d = env.root / "half-link"
    if not d.exists():
        d.mkdir()
        shutil.copy(env.outside / "adapter_config.json", d / "adapter_config.json")
        (d / "adapter_model.safetensors").symlink_to(env.outside / "adapter_model.safetensors")
    with rejected(ex, Code.PERMISSION_DENIED, PermissionDenied):
        ex.load_adapter("x", d)


def _host_dir(env: Env) -> str:
    """The temp directory holding the root and the outside adapter: no message may name it unless the
    client's own path did."""
    return os.path.commonpath([env.root.resolve(), env.outside.resolve()])


@pytest.mark.parametrize("case", [*PATH_CASES, "symlink-abs", "symlink-rel", "file-symlink", "bad-file"])
def test_messages_name_paths_as_given_never_resolved(ex, env, case):
    """PERMISSION_DENIED (and INVALID_ARGUMENT for a bad file) name the path as the client gave it, relative
    to the root when under it; never the resolved host path, nor the root's location."""
    link = env.root / "link-out"
    if not link.exists():
        link.symlink_to(env.outside, target_is_directory=True)
    half = env.root / "half-link-msg"
    if not half.exists():
        half.mkdir()
        shutil.copy(env.outside / "adapter_config.json", half / "adapter_config.json")
        (half / "adapter_model.safetensors").symlink_to(env.outside / "adapter_model.safetensors")
    if case == "bad-file":
        bad = env.copy_good("msg-bad")
        _truncate_weights(bad)
        given, cls, shown = str(bad), InvalidRequest, bad.name  # absolute under the root: shown relative
    else:
        given = {"symlink-abs": str(link), "symlink-rel": "link-out", "file-symlink": str(half)}.get(case) \
            or PATH_CASES[case](env)
        cls = PermissionDenied
        shown = str(Path(given).relative_to(env.root)) if Path(given).is_relative_to(env.root) else given
    with pytest.raises(cls) as err:
        ex.load_adapter("x", given)
    msg = str(err.value)
    assert repr(shown) in msg or msg.startswith(shown + "/"), msg
    assert _host_dir(env) not in msg.replace(given, ""), msg
    assert str(env.outside.resolve()) not in msg.replace(given, ""), msg


def test_no_root_configured(env):
    ex = make_executor(env.base, kv_blocks=12)
    assert ex.list_adapters() == []
    for path in (env.good, "good", env.outside):
        with rejected(ex, Code.PERMISSION_DENIED, PermissionDenied):
            ex.load_adapter("x", path)
    # Operator preloads do not need a root.
    pre = make_executor(env.base, kv_blocks=12, adapters=(("p", env.outside),))
    assert [a.name for a in pre.list_adapters()] == ["p"]
    with rejected(pre, Code.PERMISSION_DENIED, PermissionDenied):
        pre.load_adapter("x", env.good)


# ---------------------------------------------------------------------------------------- load: bad files
def _truncate_weights(d: Path) -> None:
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage_header(d: Path) -> None:
    f = d / "adapter_model.safetensors"
    f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])


def _wrong_b_shape(d: Path) -> None:
    def edit(t):
        key = next(k for k in t if "lora_B" in k)
        t[key] = torch.cat([t[key], t[key][:1]])  # one output row too many
    edit_adapter_tensors(d, edit)


def _wrong_a_shape(d: Path) -> None:
    def edit(t):
        key = next(k for k in t if "lora_A" in k)
        t[key] = t[key][:, :-1].clone()  # in_features - 1
    edit_adapter_tensors(d, edit)


def _rank_mismatch(d: Path) -> None:
    def edit(t):
        key = next(k for k in t if "lora_A" in k)
        t[key] = t[key][:-1].clone()  # A has r-1 rows, B still r columns
    edit_adapter_tensors(d, edit)


def _layer_out_of_range(d: Path) -> None:
    def edit(t):
        for k in [k for k in t if ".layers.0." in k]:
            t[k.replace(".layers.0.", ".layers.7.")] = t.pop(k)
    edit_adapter_tensors(d, edit)


def _missing_b(d: Path) -> None:
    def edit(t):
        del t[next(k for k in t if "lora_B" in k)]
    edit_adapter_tensors(d, edit)


def _nan_weights(d: Path) -> None:
    def edit(t):
        key = next(k for k in t if "lora_B" in k)
        t[key] = t[key].clone()
        t[key][0, 0] = float("nan")
    edit_adapter_tensors(d, edit)


def _scalar_a(d: Path) -> None:
    def edit(t):
        key = next(k for k in t if "lora_A" in k)
        t[key] = t[key][0, 0].clone()  # a 0-d tensor
    edit_adapter_tensors(d, edit)


BAD_DIRS = {
    "missing-config": lambda d: (d / "adapter_config.json").unlink(),
    "config-not-json": lambda d: (d / "adapter_config.json").write_text("{not json", encoding="utf-8"),
    "config-is-a-list": lambda d: (d / "adapter_config.json").write_text("[1, 2]", encoding="utf-8"),
    "missing-weights": lambda d: (d / "adapter_model.safetensors").unlink(),
    "truncated-weights": _truncate_weights,
    "garbage-weights": _garbage_header,
    "wrong-B-shape": _wrong_b_shape,
    "wrong-A-shape": _wrong_a_shape,
    "A-B-rank-mismatch": _rank_mismatch,
    "layer-out-of-range": _layer_out_of_range,
    "missing-B": _missing_b,
    "modules-to-save": lambda d: edit_adapter_config(d, modules_to_save=["lm_head"]),
    "target-lm_head": lambda d: edit_adapter_config(d, target_modules=["q_proj", "v_proj", "lm_head"]),
    "not-lora": lambda d: edit_adapter_config(d, peft_type="IA3"),
    "rank-zero": lambda d: edit_adapter_config(d, r=0),
    # peft itself refuses these files (its lora_A would be [2, in], the file's is [4, in]).
    "r-disagrees-with-weights": lambda d: edit_adapter_config(d, r=2),
    "scalar-A": _scalar_a,
    "rank-pattern-not-a-dict": lambda d: edit_adapter_config(d, rank_pattern=["q_proj"]),
    "rank-pattern-bad-regex": lambda d: edit_adapter_config(d, rank_pattern={"q_proj(": 2}),
    "rank-pattern-string-value": lambda d: edit_adapter_config(d, rank_pattern={"q_proj": "two"}),
    "alpha-pattern-string-value": lambda d: edit_adapter_config(d, alpha_pattern={"v_proj": "x"}),
    "alpha-not-a-number": lambda d: edit_adapter_config(d, lora_alpha="sixteen"),
}


@pytest.mark.parametrize("case", list(BAD_DIRS))
def test_bad_adapter_dir(ex, env, case):
    d = env.copy_good(case)
    BAD_DIRS[case](d)
    with rejected(ex, Code.INVALID_ARGUMENT, InvalidRequest):
        ex.load_adapter("x", d)
    # The failed load reserved nothing: the name is free for a good adapter.
    assert ex.load_adapter("x", env.good).name == "x"


def _assert_x_poisons_no_neighbour(ex) -> list[str]:
    """Adapter "x" shares one forward with a base item and an adapter-"a" item: theirs match their solo runs.
    Returns the ids of the caches it made."""
    ref = ex.prefill(PROMPT, output=LOGITS)
    ref_a = ex.prefill(PROMPT, output=LOGITS, adapter="a")
    res = ex.unified_decode([UnifiedItem(tuple(PROMPT), output=LOGITS), UnifiedItem(tuple(PROMPT), adapter="x"),
                             UnifiedItem(tuple(PROMPT), output=LOGITS, adapter="a")])
    assert rel_err(res[0].output.logits[0], ref.output.logits[0]) < 1e-5, "base item poisoned"
    assert rel_err(res[2].output.logits[0], ref_a.output.logits[0]) < 1e-5, "adapter a's item poisoned"
    return [r.cache.cache_id for r in (ref, ref_a, *res)]


def test_nan_weights_rejected_or_harmless(ex, env):
    """NaN in an adapter: refusing it (INVALID_ARGUMENT) is best; if it loads, the base model and other
    adapters sharing a batch with it must not be poisoned."""
    d = env.copy_good("nan")
    _nan_weights(d)
    try:
        ex.load_adapter("x", d)
    except TandemError as e:
        assert status_for(e) == Code.INVALID_ARGUMENT
        return
    _assert_x_poisons_no_neighbour(ex)


def test_huge_adapter_does_not_poison_its_batch(ex, env):
    """Finite but huge weights (the projection overflows to inf: in fp16 that is any value past 65504) may
    ruin that adapter's own output, never the base items' or another adapter's sharing the forward."""
    d = env.copy_good("huge")

    def edit(t):
        for k in [k for k in t if "lora_A" in k]:
            t[k] = torch.full_like(t[k], 3e38)  # finite; x @ A.T overflows for any token
    edit_adapter_tensors(d, edit)
    try:
        ex.load_adapter("x", d)
    except TandemError as e:  # refusing it is fine too
        assert status_for(e) == Code.INVALID_ARGUMENT
        return
    ex.release_cache(_assert_x_poisons_no_neighbour(ex))
    assert kv_all_free(ex)


def test_target_module_outside_set(ex, env):
    """An adapter peft made for lm_head / embed_tokens is refused (only the 7 projections are supported)."""
    for target in (["lm_head"], ["embed_tokens"]):
        d = make_peft_adapter(env.base, env.root / f"t-{target[0]}", r=4, alpha=8, target_modules=target, seed=5)
        with rejected(ex, Code.INVALID_ARGUMENT, InvalidRequest):
            ex.load_adapter("x", d)


def test_rank_above_max(ex, env):
    d = env.root / "r32"
    if not d.exists():
        make_peft_adapter(env.base, d, r=32, alpha=32, target_modules=("q_proj",), seed=6)
    with rejected(ex, Code.INVALID_ARGUMENT, InvalidRequest, str(MAX_RANK)):
        ex.load_adapter("x", d)
    exact = env.root / "r16"
    if not exact.exists():
        make_peft_adapter(env.base, exact, r=MAX_RANK, alpha=16, target_modules=("q_proj",), seed=6)
    assert ex.load_adapter("x", exact).rank == MAX_RANK


def test_adapter_for_another_model(ex, env, tiny_checkpoint):
    """An adapter trained for a model with another hidden size does not fit this one."""
    other_base = tiny_checkpoint("llama", config_overrides={"hidden_size": 32, "intermediate_size": 96})
    d = env.root / "for-other-model"
    if not d.exists():
        make_peft_adapter(other_base, d, r=4, alpha=8, target_modules=ALL_MODULES, seed=7)
    with rejected(ex, Code.INVALID_ARGUMENT, InvalidRequest):
        ex.load_adapter("x", d)


def test_bad_preload_fails_startup(env):
    d = env.copy_good("bad-preload")
    _truncate_weights(d)
    with pytest.raises(Exception):
        make_executor(env.base, kv_blocks=12, adapter_root=env.root, adapters=(("p", d),))


PATTERNS = {  # name -> (target_modules, rank_pattern, alpha_pattern); keys are regexes, as peft matches them
    "by-module": (["q_proj", "v_proj", "down_proj"], {"v_proj": 2}, {"down_proj": 3}),
    "by-layer": (["q_proj", "o_proj"], {"layers.1.self_attn.q_proj": 2}, {"model.layers.0.self_attn.o_proj": 32}),
    "alternation": (["q_proj", "o_proj", "down_proj"], {}, {"o_proj|down_proj": 3}),
}


@pytest.mark.parametrize("case", list(PATTERNS))
def test_rank_and_alpha_patterns_exact_or_refused(ex, env, case):
    """peft's rank_pattern / alpha_pattern (per-module rank and alpha; each key is a regex that must match the
    end of the module's name, as a whole group: peft.utils.other.get_pattern_key): served exactly like peft,
    or refused with INVALID_ARGUMENT; never silently scaled wrong."""
    d = env.root / f"patterns-{case}"
    if not d.exists():
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        targets, ranks, alphas = PATTERNS[case]
        base = AutoModelForCausalLM.from_pretrained(env.base)
        torch.manual_seed(8)
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, rank_pattern=ranks,
                         alpha_pattern=alphas)
        get_peft_model(base, cfg).save_pretrained(d)
    try:
        info = ex.load_adapter("pat", d)
    except TandemError as e:
        assert status_for(e) == Code.INVALID_ARGUMENT, e
        return
    assert info.rank == 8
    got = ex.prefill(PROMPT, output=LOGITS, adapter="pat")
    want = PeftReference(env.base, d).last_logits(PROMPT)
    assert rel_err(got.output.logits[0], want) < 1e-4
    ex.release_cache([got.cache.cache_id])


# ---------------------------------------------------------------------------------------- gRPC
@pytest.fixture(scope="module")
def server(request, env):
    return start_for(request, env.base, "--kv-blocks", "32", "--adapter-root", str(env.root),
                     "--adapter", f"a={env.good}", "--max-lora-rank", str(MAX_RANK),
                     "--max-adapters-on-device", "2")


def rpc_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_grpc_adapter_rpcs(server, env):
    stub = server.stub
    info = stub.GetInfo(pb.GetInfoRequest())
    assert list(info.adapters) == ["a"]
    (a,) = stub.ListAdapters(pb.ListAdaptersRequest()).adapters
    assert a.name == "a" and a.rank == 4 and set(a.target_modules) == {"q_proj", "v_proj"}
    assert Path(a.path).resolve() == env.good.resolve()

    # Prefill on the adapter matches peft.
    with_logits = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
    r = stub.Prefill(pb.PrefillRequest(token_ids=PROMPT, output=with_logits, adapter="a"))
    want = PeftReference(env.base, env.good).last_logits(PROMPT)
    got = torch.from_numpy(np.array(codec.decode_logits(r.output.logits)[0]))
    assert rel_err(got, want) < 1e-4
    base_want = HfReference(env.base).last_logits(PROMPT)
    assert rel_err(base_want, want) > 1e-2  # the adapter did something
    d = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=r.cache, token_id=r.output.tokens[0].token_id,
                                                          adapter="a")], num_steps=3))
    assert d.results[0].cache.seq_len == len(PROMPT) + 3

    # Errors and their codes.
    assert rpc_code(lambda: stub.Prefill(pb.PrefillRequest(token_ids=PROMPT, adapter="nope"))) == Code.NOT_FOUND
    (u,) = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[
        pb.UnifiedItem(token_ids=PROMPT, is_final_chunk=True, adapter="nope")])).results
    assert u.status.code == Code.NOT_FOUND.value[0] and "adapter 'nope'" in u.status.message
    (w,) = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=d.results[0].cache, token_id=5,
                                                             adapter="")])).results
    assert w.status.code == Code.FAILED_PRECONDITION.value[0]
    assert rpc_code(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"))) == Code.FAILED_PRECONDITION
    assert rpc_code(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="nope"))) == Code.NOT_FOUND
    assert rpc_code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(env.other)))) \
        == Code.FAILED_PRECONDITION
    assert rpc_code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="x", path=str(env.outside)))) \
        == Code.PERMISSION_DENIED
    dotdot = str(Path("..") / env.outside.parent.name / env.outside.name)
    assert rpc_code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="x", path=dotdot))) == Code.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="x", path=dotdot))
    assert repr(dotdot) in err.value.details() and _host_dir(env) not in err.value.details()
    assert rpc_code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="bad name", path="other"))) \
        == Code.INVALID_ARGUMENT
    bad = env.copy_good("grpc-bad")
    _truncate_weights(bad)
    assert rpc_code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="x", path=str(bad)))) \
        == Code.INVALID_ARGUMENT
    assert [x.name for x in stub.ListAdapters(pb.ListAdaptersRequest()).adapters] == ["a"]

    # Metrics: "a" served 1 prefill item + 3 decode items; its weights were loaded once.
    (m,) = stub.GetMetrics(pb.GetMetricsRequest()).adapters
    assert m.name == "a" and m.requests == 4 and m.loads == 1 and m.evictions == 0 and m.active_caches == 1
    assert m.on_device

    # Runtime load (path relative to the root), use, unload.
    loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name="b", path="other")).adapter
    assert loaded.name == "b" and loaded.rank == 8 and set(loaded.target_modules) == set(ALL_MODULES)
    assert sorted(stub.GetInfo(pb.GetInfoRequest()).adapters) == ["a", "b"]
    rb = stub.Prefill(pb.PrefillRequest(token_ids=PROMPT, adapter="b"))
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[rb.cache.cache_id, r.cache.cache_id]))
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="b"))
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"))
    assert list(stub.ListAdapters(pb.ListAdaptersRequest()).adapters) == []
    assert list(stub.GetInfo(pb.GetInfoRequest()).adapters) == []
    assert list(stub.GetMetrics(pb.GetMetricsRequest()).adapters) == []
    assert rpc_code(lambda: stub.Prefill(pb.PrefillRequest(token_ids=PROMPT, adapter="a"))) == Code.NOT_FOUND
    kv = stub.GetInfo(pb.GetInfoRequest()).kv
    assert kv.free_blocks == kv.total_blocks and kv.active_caches == 0
    # Load it back for whatever runs next on this server.
    stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(env.good)))
