"""How close a run on a device must come to the CPU float32 reference, per dtype, in one place (tests/devices.py
chooses the dtype of each device). Both measures are relative to the reference's largest |logit| at that step,
as tests/hf_reference.rel_err is.

float32 (the CPU runs): the same arithmetic in another order (packed batches, paged attention, fused
projections) differs by float32 rounding only, ~1e-6 of the largest logit on the tiny models; 1e-4 leaves room for
a few layers' accumulation and is what the suite has always asserted. Greedy tokens must then be equal: a tie
between the top two logits closer than 1e-4 does not happen on these seeded prompts.

bfloat16 (the CUDA runs, the executor's default dtype there): 8 bits of mantissa, half an ulp = 2^-9 ≈ 0.2% per
rounding, and the weights, activations and K/V are all rounded. Measured on the CPU in bfloat16 against float32
(teacher-forced, 3 prompts of 30 tokens, 24 steps, on the tiny Llama/Qwen2/Qwen3 and every dense family): median
step error 1.3-2.7% of the largest logit, p90 1.6-5%, worst 2.2-9.9% (Gemma 3). 0.2 is twice the worst seen and
still below a wrong model (a missing rotary, a wrong layer order or mask: 30-100%). The tiny random models'
distributions are flat (the top two within 1% of the largest logit at one step in ten), so bfloat16 flips near
ties: a greedy token may differ from the reference's where the reference leads ours by under 0.1 of its largest
logit (twice the p90 error); from there the two sequences continue from different tokens, so the comparison stops
at that step. MoE models are not held to these: a near tie of the router flips an expert, a discrete change of
26-54% at a step (Mixtral, GPT-OSS, same measure); their tests stay on the CPU (docs/cuda.md).

Embeddings (pooled hidden states) are compared by cosine: a relative L2 error e gives a cosine of at least
sqrt(1 - e^2), so bfloat16's 0.2 allows 0.98; float32's 0.9999 is what the pooling tests have always asserted."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tests.hf_reference import rel_err


@dataclass(frozen=True)
class Tolerance:
    logits: float  # max |ours - ref| / max |ref| allowed at every compared step
    tie: float  # a greedy token may differ where the reference's top-two gap / max |ref| is below this
    cosine: float  # an embedding's cosine similarity to the reference's is at least this


TOLERANCES = {
    torch.float32: Tolerance(logits=1e-4, tie=0.0, cosine=0.9999),
    torch.bfloat16: Tolerance(logits=0.2, tie=0.1, cosine=0.98),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[dtype]


def lead(ref_logits: torch.Tensor, token: int) -> float:
    """How far the reference's argmax leads `token` in one row [V], over its largest |logit|."""
    ref = ref_logits.float()
    return float((ref.max() - ref[token]) / ref.abs().max())


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    """One step's logits within the dtype's tolerance of the reference; returns the relative error."""
    err = rel_err(got, want)
    assert err < tolerance(dtype).logits, f"{what}: relative error {err:.2e} over {tolerance(dtype).logits} ({dtype})"
    return err


def greedy_agreement(tokens: Sequence[int], logits: Sequence[torch.Tensor], ref_tokens: Sequence[int],
                     ref_logits: Sequence[torch.Tensor], dtype: torch.dtype, what: str = "") -> int:
    """A greedy run against its reference, step by step: logits within the dtype's tolerance, tokens equal, until
    the first step where the tokens differ — allowed only at a near tie of the reference (float32: never);
    the steps after it continue from other tokens and are not compared. Returns the number of steps compared
    with equal tokens (len(tokens) when they all agree)."""
    tol = tolerance(dtype)
    assert len(tokens) == len(ref_tokens), f"{what}: {len(tokens)} tokens, the reference has {len(ref_tokens)}"
    for step, (token, ref_token) in enumerate(zip(tokens, ref_tokens)):
        if logits:
            assert_logits_close(logits[step], ref_logits[step], dtype, f"{what} step {step}")
        if token != ref_token:
            gap = lead(ref_logits[step], token)
            assert gap < tol.tie, (f"{what} step {step}: token {token}, the reference's {ref_token} leads it by "
                                   f"{gap:.2e} of the largest logit ({dtype} allows a flip below {tol.tie})")
            return step
    return len(tokens)


def assert_greedy_token(token: int, ref_logits: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """One greedy token is the reference's argmax, or the dtype's rounding flipped a near tie (float32: never)."""
    ref_token = int(ref_logits.argmax())
    if token != ref_token:
        gap = lead(ref_logits, token)
        assert gap < tolerance(dtype).tie, (f"{what}: token {token}, the reference's {ref_token} leads by {gap:.2e} "
                                            f"of the largest logit ({dtype} allows a flip below {tolerance(dtype).tie})")
