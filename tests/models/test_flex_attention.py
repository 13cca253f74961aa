"""FlexAttention paged attention (models/attention/flex.py) against the gathered path (models/attention/paged.py) on
every family's tiny checkpoint: the same batches (fresh prefill, a chunk after cached tokens, a prefix hit
through shared blocks, decode, draft verify, sliding windows with the null block) on two pools, logits within
fp32 1e-4 and the same greedy tokens. Flex runs eagerly here (torch 2.13's CPU flex template: see the module);
one test runs it compiled on the tiny Llama. The tiny-Llama scenarios run on CUDA too where there is one (marked
`cuda`: scripts/gpu_check), eager and compiled (Triton's flex kernel, the CUDA serving path)."""
from __future__ import annotations

import pytest
import torch

from models.attention.paged import ItemLayout
from models.attention.backend import AttentionBuilder, choose_backend
from models.attention.spec import AttentionSpec
from models.attention.flex import FlexMetadata
from models.kv.paged_cache import PagedKvCache
from models.loader import load_model
from tests.devices import CUDA_MARKS
from tests.models.family_checkpoints import FAMILIES

BS = 16
POOL = 24
ON_CUDA = pytest.param("cuda", marks=CUDA_MARKS)  # flex against gathered, both ours: float32 on both devices


def _pair(model, compile_flex: bool = False):
    cfg = model.config
    device = next(model.parameters()).device
    pools = [PagedKvCache(cfg.num_layers, POOL, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                          device, cfg.kv_window) for _ in range(2)]
    builders = [AttentionBuilder(name, kv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device,
                                 compile_flex=compile_flex) for name, kv in zip(("gathered", "flex"), pools)]
    return pools, builders


def _run_scenario(model, compile_flex: bool = False) -> int:
    """Runs the batches on both backends (on the model's device), asserting logits and greedy tokens agree;
    returns the rows compared."""
    pools, builders = _pair(model, compile_flex)
    window = pools[0].window
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    # item -> its block table (blocks 0-1 shared by A and C: C's prompt starts with A's first 32 tokens)
    tables = {"A": [0, 1, 2, 3], "B": [4, 5, 6], "C": [0, 1, 7, 8]}
    a, b = ids(37), ids(20)
    batches = [
        [("A", 0, a), ("B", 0, b)],  # fresh prefill of different lengths
        [("A", 37, ids(1)), ("B", 20, ids(15))],  # decode beside a chunk after cached tokens
        [("A", 38, ids(4)), ("C", 32, ids(10)), ("B", 35, ids(1))],  # draft verify; prefix hit; decode
        [("A", 42, ids(1)), ("C", 42, ids(3))],
    ]
    rows = 0
    with torch.inference_mode():
        for step, batch in enumerate(batches):
            if window is not None and step == 3:
                # A has moved past its first block's window (all-sliding model): the cache frees it, and the
                # table points at the never-written null block instead (models/kv/paged_cache.py)
                tables["A"][0] = pools[0].null_block
            items = [ItemLayout(tables[name], past, len(tok)) for name, past, tok in batch]
            input_ids = torch.tensor([t for _, _, tok in batch for t in tok], device=next(model.parameters()).device)
            out = [model(input_ids, builder(items), kv, None) for builder, kv in zip(builders, pools)]
            want, got = out
            scale = float(want.abs().max())
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale), (step, float((got - want).abs().max()))
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            rows += len(input_ids)
    return rows


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_tiny_llama_flex_matches_gathered(model_dir, device):
    assert _run_scenario(load_model(model_dir, device, "float32", progress=False)) == 92


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_flex_matches_gathered(family_checkpoint, family, device):
    model = load_model(family_checkpoint(family), device, "float32", progress=False)
    assert _run_scenario(model) == 92


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.long), ON_CUDA])
def test_compiled_flex_matches_gathered(model_dir, device):
    """The compiled form (inductor's C++ flex template on CPU, under --long: ~20 s of compile on 2 cores, and CPU
    serving does not compile flex, docs/cuda.md; Triton's kernel on CUDA): every batch of the scenario, one
    dynamic graph."""
    assert _run_scenario(load_model(model_dir, device, "float32", progress=False), compile_flex=True) == 92


@pytest.mark.parametrize("spec,sinks", [(AttentionSpec(0.25), False), (AttentionSpec(0.25, window=24), False),
                                        (AttentionSpec(0.25, softcap=3.0), False),
                                        (AttentionSpec(0.25, window=24, softcap=3.0), True)])
def test_flex_layer_matches_gathered_layer(spec, sinks):
    """One layer's attention alone: windows, soft caps and sinks (the sigmoid(lse - sink) rescale)."""
    from models.attention.paged import AttentionMetadata
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d = 4, 2, 16
    pools = [PagedKvCache(1, 20, BS, kv_heads, d, torch.float32, torch.device("cpu")) for _ in range(2)]
    pools[0].k.normal_(generator=g)
    pools[0].v.normal_(generator=g)
    pools[1].k.copy_(pools[0].k)
    pools[1].v.copy_(pools[0].v)
    items = [ItemLayout([3, 7, 1], 20, 1), ItemLayout([5, 9], 0, 17), ItemLayout([11, 12, 13], 30, 5)]
    total = sum(it.n_new for it in items)
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    sink = torch.randn(heads, generator=g) if sinks else None
    want = AttentionMetadata(items, BS, heads // kv_heads, torch.device("cpu"), torch.float32).attend(
        q, k, v, pools[0], 0, spec, sink)
    got = FlexMetadata(items, BS, 20, torch.device("cpu")).attend(q, k, v, pools[1], 0, spec, sink)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_backend("auto", cpu) == "gathered"  # measured faster for CPU prefill (docs/cuda.md)
    assert choose_backend("flex", cpu) == "flex"
    assert choose_backend("auto", cuda, has_sinks=True) == "flex"
    assert choose_backend("auto", cuda, has_sinks=True, block_size=8) == "gathered"  # Triton's tile is >= 16
    with pytest.raises(ValueError, match="multiple of 16, got 8"):
        choose_backend("flex", cuda, block_size=8)
    assert choose_backend("flex", cpu, block_size=8) == "flex"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_backend("flashinfer", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        choose_backend("sdpa", cpu)


def test_executor_serves_with_flex(model_dir):
    """The executor built with --attention-backend flex (eager decode steps too) gives the gathered executor's
    greedy tokens, prompt chunked; it reports the backend it runs."""
    from tests.executor_driver import greedy_run, make_executor
    prompt = list(range(5, 45))
    runs = []
    for backend in ("gathered", "flex"):
        ex = make_executor(model_dir, kv_blocks=32, attention_backend=backend, decode_kernel="torch")
        assert ex.stack.attention_backend == backend
        runs.append(greedy_run(ex, prompt, 6, chunk=16))
    (_, want, want_logits), (_, got, got_logits) = runs
    assert got == want
    for g, w in zip(got_logits, want_logits):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
