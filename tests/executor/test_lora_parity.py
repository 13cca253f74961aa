"""Multi-LoRA parity: the executor with PEFT adapters against peft's own forward on tiny fp32
checkpoints: whole and chunked prefill, decode steps, mixed batches of base + several adapters, the
device LRU (max_adapters_on_device) and unload / reload."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tandem.errors import AdapterNotFound, InvalidRequest
from tests.device_tolerances import greedy_agreement
from tests.executor_driver import LOGITS, greedy_run, make_executor, mixed_batch_run, warm_prefixes
from tests.lora_fixtures import ALL_MODULES, HfReference, PeftReference, make_peft_adapter, rel_err

TOL = 1e-4
STEPS = 8

# name -> make_peft_adapter keyword arguments. Different ranks, scalings and target sets, so that a mix-up
# between adapters (or a wrong scaling, or a module left out) shows in the logits.
ADAPTERS: dict[str, dict] = {
    "all8": dict(r=8, alpha=16, target_modules=ALL_MODULES, seed=1),
    "qv4": dict(r=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=2),
    "mlp16": dict(r=16, alpha=8, target_modules=("gate_proj", "up_proj", "down_proj"), seed=3),
    "rs8": dict(r=8, alpha=4, target_modules=("k_proj", "o_proj", "down_proj"), seed=4, use_rslora=True),
}


def prompt_of(length: int, seed: int = 0, low: int = 3, high: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]


PROMPT = prompt_of(19, seed=1)  # shared where it can be: peft references are cached per (adapter, prompt)


class Setup:
    """A tiny base checkpoint, an adapter root holding ADAPTERS, and cached references."""

    def __init__(self, base: Path, root: Path, specs: dict[str, dict]) -> None:
        self.base, self.root, self.specs = base, root, specs
        self.dirs = {name: make_peft_adapter(base, root / name, **kw) for name, kw in specs.items()}
        self._models: dict[str, HfReference | PeftReference] = {}
        self._greedy: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}  # (adapter, prompt) -> longest run

    def ref(self, adapter: str) -> HfReference | PeftReference:
        if adapter not in self._models:
            self._models[adapter] = (HfReference(self.base) if not adapter
                                     else PeftReference(self.base, self.dirs[adapter]))
        return self._models[adapter]

    def greedy(self, adapter: str, prompt: list[int], steps: int = STEPS) -> tuple[list[int], list[torch.Tensor]]:
        key = (adapter, tuple(prompt))
        if key not in self._greedy or len(self._greedy[key][0]) < steps:
            self._greedy[key] = self.ref(adapter).greedy(prompt, steps)
        tokens, logits = self._greedy[key]
        return tokens[:steps], logits[:steps]

    def executor(self, preload: tuple[str, ...] = (), **kwargs):
        return make_executor(self.base, adapter_root=self.root,
                             adapters=tuple((n, self.dirs[n]) for n in preload), **kwargs)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint, tmp_path_factory) -> Setup:
    return Setup(tiny_checkpoint("llama"), tmp_path_factory.mktemp("lora-llama"), ADAPTERS)


def run_greedy(ex, prompt: list[int], steps: int, adapter: str, chunk: int | None = None
               ) -> tuple[str, list[int], list[torch.Tensor]]:
    return greedy_run(ex, prompt, steps, chunk, adapter)


def assert_matches(got: tuple[list[int], list[torch.Tensor]], ref: tuple[list[int], list[torch.Tensor]],
                   what: str, dtype: torch.dtype = torch.float32) -> None:
    """Tokens and logits against the reference within the dtype's tolerance (tests/device_tolerances.py)."""
    tokens, logits = got
    ref_tokens, ref_logits = ref
    assert len(logits) == len(ref_logits)
    greedy_agreement(tokens, logits, ref_tokens, ref_logits, dtype, what)


def needs_peft(device) -> None:
    """The references are peft's: a lent GPU's bundle does not carry peft yet (docs/cuda.md, "What waits")."""
    if device.name == "cuda":
        pytest.importorskip("peft", reason="peft is not installed here (scripts/gpu_bundle does not carry it yet)")


def kv_all_free(ex) -> bool:
    u = ex.kv_usage()
    return u.free_blocks == u.total_blocks and u.active_caches == 0


def adapters_by_name(ex) -> dict:
    return {a.name: a for a in ex.list_adapters()}


def test_fixture_adapters_change_the_model(llama):
    """Guards the fixtures: each adapter moves the logits far beyond the tolerance, and no two agree."""
    prompt = prompt_of(13, seed=5)
    rows = {name: llama.ref(name).last_logits(prompt) for name in ["", *ADAPTERS]}
    names = list(rows)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert rel_err(rows[a], rows[b]) > 0.05, f"adapters {a!r} and {b!r} give nearly the same logits"


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_matches_peft(llama, name, device):
    """Preloaded adapter (ExecutorConfig.adapters): prefill + STEPS-1 decode steps match peft's logits and
    greedy tokens; the base model on the same executor still matches plain transformers. On CUDA the base
    model's decode steps replay CUDA graphs and the adapter's run the eager forward, on one executor."""
    needs_peft(device)
    ex = llama.executor(preload=(name,), device=device)
    prompt = PROMPT
    cid, tokens, logits = run_greedy(ex, prompt, STEPS, name)
    assert_matches((tokens, logits), llama.greedy(name, prompt), f"adapter {name}", device.dtype)
    assert ex.cache_length(cid) == len(prompt) + STEPS - 1
    info = adapters_by_name(ex)[name]
    spec = ADAPTERS[name]
    assert info.rank == spec["r"] and set(info.target_modules) == set(spec["target_modules"])
    assert Path(info.path).resolve() == llama.dirs[name].resolve()
    assert info.active_caches == 1 and info.requests == STEPS  # 1 prefill item + STEPS-1 decode items
    base_cid, base_tokens, base_logits = run_greedy(ex, prompt, STEPS, "")
    assert_matches((base_tokens, base_logits), llama.greedy("", prompt), "base model beside an adapter",
                   device.dtype)
    ex.release_cache([cid, base_cid])
    assert kv_all_free(ex) and adapters_by_name(ex)[name].active_caches == 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain-linear"])
def test_runtime_load_and_chunked_prefill(llama, packed):
    """load_adapter at run time (path relative to adapter_root), prompt in chunks of 5 via unified_decode,
    with and without the CPU packed-weight path."""
    ex = llama.executor(cpu_packed_weights=packed)
    info = ex.load_adapter("all8", "all8")
    assert info.name == "all8" and info.rank == 8 and set(info.target_modules) == set(ALL_MODULES)
    assert [a.name for a in ex.list_adapters()] == ["all8"]
    assert "all8" in ex.info().adapters
    prompt = PROMPT
    cid, tokens, logits = run_greedy(ex, prompt, STEPS, "all8", chunk=5)
    assert_matches((tokens, logits), llama.greedy("all8", prompt), "chunked prefill")
    assert adapters_by_name(ex)["all8"].requests == -(-len(prompt) // 5) + STEPS - 1  # chunks + decodes
    ex.release_cache([cid])
    assert kv_all_free(ex)


def test_qwen2_adapter(tiny_checkpoint, tmp_path_factory):
    """An untied head and q/k/v biases (Qwen2): LoRA is added to the biased projections' outputs."""
    setup = Setup(tiny_checkpoint("qwen2"), tmp_path_factory.mktemp("lora-qwen2"),
                  {"q8": dict(r=8, alpha=16, target_modules=ALL_MODULES, seed=11)})
    ex = setup.executor(preload=("q8",))
    prompt = prompt_of(17, seed=3)
    cid, tokens, logits = run_greedy(ex, prompt, STEPS, "q8")
    assert_matches((tokens, logits), setup.greedy("q8", prompt), "qwen2 adapter")
    ex.release_cache([cid])


@pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])
def test_mixed_batch_base_and_adapters(llama, prefix, device):
    """One unified_decode per step over base + three adapters (+ a second sequence of one of them):
    prefill chunks of 8 beside decodes, different prompt lengths; each sequence matches its own reference.
    prefix-on: the adapters' prompts of 17 and 26 tokens reuse their cached first block (create_caches)."""
    needs_peft(device)
    ex = llama.executor(preload=("qv4", "mlp16", "rs8"), prefix_caching=prefix, device=device)
    seqs = [("", 9), ("qv4", 17), ("mlp16", 5), ("rs8", 26), ("qv4", 3), ("", 12)]
    prompts = [prompt_of(n, seed=20 + i) for i, (_, n) in enumerate(seqs)]
    sizes, caches = set(), set()

    def seen(items, results):
        sizes.add(len({it.adapter for it in items}))
        caches.update(r.cache.cache_id for r in results)
    if prefix:
        warm_prefixes(ex, prompts, [a for a, _ in seqs])
    gen, logits = mixed_batch_run(ex, prompts, STEPS, adapters=[a for a, _ in seqs], release=False, on_step=seen,
                                  create=(1, 3, 5) if prefix else ())
    assert ex.prefix_stats().hit_tokens == (32 if prefix else 0)
    assert 4 in sizes, "some forward should carry base + all three adapters"
    for i, (adapter, _) in enumerate(seqs):
        assert_matches((gen[i], logits[i]), llama.greedy(adapter, prompts[i]), f"sequence {i} ({adapter or 'base'})",
                       device.dtype)
    listed = adapters_by_name(ex)
    assert listed["qv4"].active_caches == 2 and listed["mlp16"].active_caches == 1
    ex.release_cache(sorted(caches))
    assert kv_all_free(ex)
    assert all(a.active_caches == 0 for a in ex.list_adapters())


def test_large_mixed_batch_non_contiguous(llama):
    """A prefill-sized forward (300 tokens: above the size where the executor stops stacking adapters) in
    which one adapter's items are not adjacent, then a decode-sized step over the same caches. Each item
    matches its own reference."""
    ex = llama.executor(preload=("qv4", "mlp16", "all8"))
    seqs = [("", 90), ("qv4", 80), ("", 40), ("qv4", 30), ("mlp16", 35), ("all8", 25)]
    assert sum(n for _, n in seqs) == 300
    prompts = [prompt_of(n, seed=80 + i) for i, (_, n) in enumerate(seqs)]
    results = ex.unified_decode([UnifiedItem(tuple(p), output=LOGITS, adapter=a) for (a, _), p in zip(seqs, prompts)])
    refs = [llama.greedy(a, p, 2) for (a, _), p in zip(seqs, prompts)]
    for i, (res, (ref_tokens, ref_logits)) in enumerate(zip(results, refs)):
        assert rel_err(res.output.logits[0], ref_logits[0]) < TOL, f"item {i} ({seqs[i][0] or 'base'}), prefill"
        assert res.output.tokens[0].token_id == ref_tokens[0]
    steps = ex.unified_decode([UnifiedItem((r.output.tokens[0].token_id,), r.cache.cache_id, r.cache.seq_len,
                                           output=LOGITS, adapter=a) for (a, _), r in zip(seqs, results)])
    for i, (res, (ref_tokens, ref_logits)) in enumerate(zip(steps, refs)):
        assert rel_err(res.output.logits[0], ref_logits[1]) < TOL, f"item {i} ({seqs[i][0] or 'base'}), decode"
        assert res.output.tokens[0].token_id == ref_tokens[1]
    ex.release_cache([r.cache.cache_id for r in results])
    assert kv_all_free(ex)


def check_lru(ex, limit: int) -> None:
    listed = ex.list_adapters()
    on = [a.name for a in listed if a.on_device]
    assert len(on) <= limit, f"{len(on)} adapters on the device ({on}), limit {limit}"
    for a in listed:  # every load to the device is matched by an eviction, except for the one resident now
        assert a.loads - a.evictions == int(a.on_device), a


def test_lru_rotation_keeps_outputs_exact(llama):
    """max_adapters_on_device=2 with 4 live caches on 4 adapters, decoded round-robin: every step needs an
    adapter that was evicted. Outputs stay exact; at most 2 adapters on the device; evictions counted."""
    names = list(ADAPTERS)
    ex = llama.executor(max_adapters_on_device=2)
    for n in names:
        ex.load_adapter(n, llama.dirs[n])
    check_lru(ex, 2)
    prompts = {n: PROMPT for n in names}  # the adapters alone make the sequences differ
    caches, tokens, logits = {}, {n: [] for n in names}, {n: [] for n in names}
    for n in names:
        res = ex.prefill(prompts[n], output=LOGITS, adapter=n)
        caches[n] = res.cache.cache_id
        tokens[n].append(res.output.tokens[0].token_id)
        logits[n].append(res.output.logits[0])
        check_lru(ex, 2)
    for _ in range(STEPS - 1):  # rounds
        for n in names:
            pos = len(prompts[n]) + len(tokens[n]) - 1
            (d,) = ex.decode([DecodeItem(CacheRef(caches[n], pos), tokens[n][-1], output=LOGITS, adapter=n)])
            tokens[n].append(d.output.tokens[0].token_id)
            logits[n].append(d.output.logits[0])
            check_lru(ex, 2)
    for n in names:
        assert_matches((tokens[n], logits[n]), llama.greedy(n, prompts[n]), f"adapter {n} under LRU")
    listed = adapters_by_name(ex)
    assert sum(a.evictions for a in listed.values()) >= len(names) * (STEPS - 1) - 2
    assert all(a.loads >= STEPS - 1 for a in listed.values())
    assert all(a.requests == STEPS for a in listed.values())
    # Two adapters alternating now fit on the device: at most the 2 evictions that bring them in.
    ex.release_cache(list(caches.values()))
    before = sum(a.evictions for a in ex.list_adapters())
    for _ in range(3):
        for n in names[:2]:
            ex.release_cache([ex.prefill(prompts[n], adapter=n).cache.cache_id])
    assert sum(a.evictions for a in ex.list_adapters()) <= before + 2
    check_lru(ex, 2)
    assert kv_all_free(ex)


def test_batch_with_more_adapters_than_device_slots(llama):
    """Three adapters in one batch with max_adapters_on_device=2: the items of the first two run exactly;
    the third adapter's item fails alone (INVALID_ARGUMENT naming the limit), writes nothing and is not
    counted. Never a wrong answer."""
    names = ["qv4", "mlp16", "rs8"]
    ex = llama.executor(preload=tuple(names), max_adapters_on_device=2)
    prompts = {n: prompt_of(6 + i, seed=60 + i) for i, n in enumerate(names)}
    items = [UnifiedItem(tuple(prompts[n]), output=LOGITS, adapter=n) for n in names]
    items.append(UnifiedItem(tuple(prompts["qv4"]), output=LOGITS, adapter="qv4"))  # a slot already taken
    results = ex.unified_decode(items)
    over = results[2]
    assert isinstance(over.error, InvalidRequest) and "max-adapters-on-device" in str(over.error)
    assert over.cache.cache_id == "" and ex.kv_usage().active_caches == 3
    assert {a.name: a.requests for a in ex.list_adapters()} == {"qv4": 2, "mlp16": 1, "rs8": 0}
    for n, res in zip(names[:2] + ["qv4"], results[:2] + results[3:]):
        ref_tokens, ref_logits = llama.greedy(n, prompts[n], 1)
        assert res.error is None and rel_err(res.output.logits[0], ref_logits[0]) < TOL
        assert res.output.tokens[0].token_id == ref_tokens[0]
    ex.release_cache([r.cache.cache_id for r in results if r.error is None])
    assert kv_all_free(ex)
    check_lru(ex, 2)


def test_unload_then_not_found_then_reload(llama):
    ex = llama.executor(preload=("qv4", "mlp16"))
    prompt = PROMPT
    cid, tokens, logits = run_greedy(ex, prompt, 3, "qv4")
    assert_matches((tokens, logits), llama.greedy("qv4", prompt, 3), "before unload")
    ex.release_cache([cid])
    assert ex.unload_adapter("qv4") is None
    assert [a.name for a in ex.list_adapters()] == ["mlp16"]
    assert "qv4" not in ex.info().adapters
    with pytest.raises(AdapterNotFound, match="qv4"):
        ex.prefill(prompt, adapter="qv4")
    base, gone = ex.unified_decode([UnifiedItem(tuple(prompt)), UnifiedItem(tuple(prompt), adapter="qv4")])
    assert isinstance(gone.error, AdapterNotFound) and "qv4" in str(gone.error)  # fails alone; the base item ran
    ex.release_cache([base.cache.cache_id])
    assert kv_all_free(ex)
    # Reload under the same name (fresh counters), and the same files under another name.
    info = ex.load_adapter("qv4", llama.dirs["qv4"])
    assert info.requests == 0 and info.active_caches == 0
    ex.load_adapter("qv4-again", llama.dirs["qv4"])
    for name in ("qv4", "qv4-again"):
        cid, tokens, logits = run_greedy(ex, prompt, 3, name)
        assert_matches((tokens, logits), llama.greedy("qv4", prompt, 3), f"after reload as {name}")
        ex.release_cache([cid])
    assert sorted(a.name for a in ex.list_adapters()) == ["mlp16", "qv4", "qv4-again"]
    assert kv_all_free(ex)
    # The name again, now for other weights: nothing derived from the old "qv4" (stacked copies) may survive.
    ex.unload_adapter("qv4")
    ex.load_adapter("qv4", llama.dirs["mlp16"])
    cid, tokens, logits = run_greedy(ex, prompt, 3, "qv4")
    assert_matches((tokens, logits), llama.greedy("mlp16", prompt, 3), "name reused for other weights")
    ex.release_cache([cid])


def test_forward_verify_and_multi_step_decode(llama):
    """forward_verify (every position's logits) and Decode with num_steps > 1 (two caches on two adapters in
    one batch) with adapters, against peft."""
    ex = llama.executor(preload=("all8", "qv4"))
    n = len(PROMPT)
    ref_tokens, _ = llama.greedy("all8", PROMPT)
    res = ex.prefill(PROMPT, adapter="all8")
    draft = [ref_tokens[0], 17, 42, ref_tokens[1]]  # whatever tokens: verify scores each position
    v = ex.forward_verify(CacheRef(res.cache.cache_id, n), draft, output=LOGITS, adapter="all8")
    want = llama.ref("all8").all_logits(PROMPT + draft)[n:]
    assert len(v.positions) == len(draft)
    for i, pos in enumerate(v.positions):
        assert rel_err(pos.logits[0], want[i]) < TOL, f"verify position {i}"
    ex.release_cache([res.cache.cache_id])

    caches = {name: ex.prefill(PROMPT, output=LOGITS, adapter=name) for name in ("all8", "qv4")}
    items = [DecodeItem(CacheRef(r.cache.cache_id, n), r.output.tokens[0].token_id, output=LOGITS, adapter=name)
             for name, r in caches.items()]
    results = ex.decode(items, num_steps=STEPS - 1)
    for (name, first), d in zip(caches.items(), results):
        tokens = [first.output.tokens[0].token_id] + [t.token_id for t in d.output.tokens]
        logits = [first.output.logits[0], *d.output.logits]
        assert_matches((tokens, logits), llama.greedy(name, PROMPT), f"multi-step decode on {name}")
    ex.release_cache([r.cache.cache_id for r in caches.values()])
    assert kv_all_free(ex)
