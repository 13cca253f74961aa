"""the families (Mistral, Mixtral, Gemma 2/3, Phi-3, Granite, OLMo 2, SmolLM3, GPT-OSS) through the
in-process Executor against transformers on the same tiny random fp32 checkpoints: greedy tokens equal and
logits within 1e-4 relative error, with chunked prefill, prompts and generations past the sliding windows
(and past Phi-3's LongRoPE switch at 64 positions), a mixed batch of several sequences, and preemption
(a sequence released mid-way and recomputed from its prompt and the tokens it had).

Each runs under the default decode-kernel choice (auto: native where it applies — it must refuse what it
cannot run, never answer wrongly), the eager torch step, and the compiled step's decode path (DecodeMetadata,
run eagerly here: torch.compile itself is tests/executor/test_compiled_decode.py's and takes minutes).

On CUDA (the `device` fixture: bfloat16 against the same float32 reference, tests/device_tolerances.py) the
greedy and mixed-batch tests run the default choice (`auto`: CUDA graphs, the attention backend CUDA picks), the
dense families only (a router near tie flips an MoE expert in bfloat16: not a rounding error)."""
from __future__ import annotations

import random

import pytest
import torch

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from models.config import ModelConfig
from tandem.token_mask import mask_bytes
from tests.executor_driver import LOGITS, greedy_run, make_executor, mixed_batch_run, prefill_prompt, raising
from tests.device_tolerances import greedy_agreement
from tests.hf_reference import HfReference, rel_err
from tests.models.family_checkpoints import FAMILIES

TOL = 1e-4
PROMPT_LEN = 40  # past every family's 24-token window
STEPS = 28  # to position 67: past Phi-3's original 64 (its long factors), and many windows past the prompt
KERNELS = ("auto", "torch", "decode-metadata")


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


class Family:
    """A family's checkpoint and its transformers reference runs, cached per prompt."""

    def __init__(self, name: str, model_dir) -> None:
        self.name, self.model_dir = name, model_dir
        self.hf = HfReference(model_dir)
        self.moe = bool(ModelConfig.from_dir(model_dir).num_experts)
        self._runs: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}

    def greedy(self, prompt: list[int], steps: int = STEPS):
        key = tuple(prompt)
        if key not in self._runs or len(self._runs[key][0]) < steps:
            self._runs[key] = self.hf.greedy(prompt, steps)
        tokens, logits = self._runs[key]
        return tokens[:steps], logits[:steps]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, family_checkpoint):
    return Family(request.param, family_checkpoint(request.param))


def on_device(family: "Family", device, kernel: str = "auto") -> None:
    """Skips what does not run on a CUDA device (the CPU runs everything)."""
    if device.name == "cuda" and kernel != "auto":
        pytest.skip("on CUDA the default choice runs (graphs); the other kernels are the CPU's")
    if not device.exact and family.moe:
        pytest.skip("MoE in bfloat16: a router near tie flips an expert (tests/device_tolerances.py)")


def executor_for(model_dir, kernel: str, monkeypatch, **kwargs):
    if kernel == "decode-metadata":  # CompiledDecode's path with torch.compile as the identity: eager
        monkeypatch.setattr("models.decode.compiled.torch.compile", lambda fn, **_: fn)
        return make_executor(model_dir, compile=True, **kwargs)
    return make_executor(model_dir, decode_kernel=kernel, **kwargs)


def kernel_ran(ex) -> str:
    caps = ex.info().capabilities
    return "native" if "native_decode" in caps else "compiled" if "compiled_decode" in caps else "torch"


def assert_close(name: str, tokens, logits, ref_tokens, ref_logits, dtype: torch.dtype = torch.float32) -> float:
    """Tokens and logits against the reference within the dtype's tolerance; returns the worst step's error."""
    steps = greedy_agreement(tokens, logits, ref_tokens, ref_logits, dtype, name)
    return max(rel_err(o, r) for o, r in zip(logits[:steps + 1], ref_logits))


@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_matches_transformers(family, kernel, monkeypatch, device):
    """Chunks of 7, then decode steps one at a time (the kernel's calls), 28 tokens."""
    on_device(family, device, kernel)
    ex = executor_for(family.model_dir, kernel, monkeypatch, device=device)
    prompt = prompt_of(PROMPT_LEN, seed=1)
    ref_tokens, ref_logits = family.greedy(prompt)
    cache_id, tokens, logits = greedy_run(ex, prompt, STEPS, chunk=7)
    worst = assert_close(family.name, tokens, logits, ref_tokens, ref_logits, device.dtype)
    ran = kernel_ran(ex)
    if ex.model_config.native_decode_refusal is not None:
        assert ran != "native", f"{family.name} ran the native step, which does not implement it"
    print(f"\n[family-parity] {family.name} {device} kernel={kernel} ran={ran} max_rel_err={worst:.2e}")
    ex.release_cache([cache_id])
    assert ex.kv_usage().free_blocks == ex.kv_usage().total_blocks


def test_mixed_batch_with_releases(family, device):
    """Four sequences share every forward: prompt chunks of 8 beside single-token decodes; one released early."""
    on_device(family, device)
    ex = make_executor(family.model_dir, device=device)
    prompts = [prompt_of(n, seed=10 + n) for n in (5, 19, 33, 45)]
    refs = [family.greedy(p, 16) for p in prompts]
    gen, logits = mixed_batch_run(ex, prompts, 16, {1: 6})
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        n = 6 if i == 1 else 16
        assert_close(f"{family.name} sequence {i}", gen[i], logits[i][:n], ref_tokens[:n], ref_logits[:n],
                     device.dtype)
    usage = ex.kv_usage()
    assert usage.free_blocks == usage.total_blocks and usage.active_caches == 0


def test_preempted_sequence_recomputes_the_same(family):
    """Preemption as the scheduler does it: release the cache after 10 tokens, then recompute prompt + those
    tokens (in chunks of 9) and go on decoding: the continuation equals transformers' uninterrupted run."""
    ex = make_executor(family.model_dir)
    prompt = prompt_of(30, seed=3)
    ref_tokens, ref_logits = family.greedy(prompt, 20)
    cache_id, tokens, _ = greedy_run(ex, prompt, 10)
    assert tokens == ref_tokens[:10]
    ex.release_cache([cache_id])
    resumed = prompt + tokens
    cache_id, _, out = prefill_prompt(ex, resumed, chunk=9)
    got, logits = [out.tokens[0].token_id], [out.logits[0]]
    for _ in range(9):
        (d,) = raising(ex.decode([DecodeItem(CacheRef(cache_id, len(resumed) + len(got) - 1), got[-1],
                                             output=LOGITS)]))
        got.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
    assert_close(family.name, got, logits, ref_tokens[10:], ref_logits[10:])
    ex.release_cache([cache_id])


def test_speculative_drafts_and_token_masks(family):
    """Draft tokens ride in the step (the two right ones accepted, then a wrong one refused), and a structured-
    output token mask holds the next token to the allowed set, on each family's own logits path."""
    ex = make_executor(family.model_dir)
    prompt = prompt_of(26, seed=4)
    ref_tokens, _ = family.greedy(prompt, 8)
    res = ex.prefill(prompt)
    cache_id = res.cache.cache_id
    assert res.output.tokens[0].token_id == ref_tokens[0]
    wrong = (ref_tokens[3] + 1) % 400
    (r,) = raising(ex.unified_decode([UnifiedItem((ref_tokens[0],), cache_id, len(prompt), True,
                                                  draft_token_ids=(ref_tokens[1], ref_tokens[2], wrong))]))
    assert [t.token_id for t in r.output.tokens] == ref_tokens[1:4]  # 2 drafts accepted, then the true 4th
    assert r.cache.seq_len == len(prompt) + 3
    allowed = sorted({5, 6, 7} - {ref_tokens[4]})
    mask = bytearray(mask_bytes(ex.model_config.vocab_size))  # bit t of byte t // 8 (tandem/token_mask.py)
    for t in allowed:
        mask[t // 8] |= 1 << (t % 8)
    (m,) = raising(ex.unified_decode([UnifiedItem((ref_tokens[3],), cache_id, len(prompt) + 3, True,
                                                  allowed_tokens=bytes(mask))]))
    assert m.output.tokens[0].token_id in allowed
    ex.release_cache([cache_id])


@pytest.mark.parametrize("mode,bound", [("int8", 0.15), ("fp16", 1e-2)])
def test_quantization_applies(family, mode, bound):
    """--quantization covers every family's linear layers (MoE experts and routers stay float): the logits stay
    within the mode's own error (measured on these checkpoints: int8 1e-2 to 0.11, fp16 4e-4 to 4e-3), not a
    parity claim."""
    ex = make_executor(family.model_dir, quantization=mode)
    assert ex.info().quantization == mode
    prompt = prompt_of(30, seed=8)
    out = ex.prefill(prompt, output=LOGITS).output
    assert rel_err(out.logits[0], family.hf.last_logits(prompt)) < bound
