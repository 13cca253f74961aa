"""models/sampler.py against transformers' logits processors and against the distributions it promises."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import models.sampler as sampler_mod
from tandem.errors import InvalidRequest
from models.sampler import Sampler, SamplingRow, _mix32, _mix32_, row_key
from tandem.sampling_params import SamplingParams as SP
from tests.devices import CPU, CUDA, CUDA_MARKS

# the sampler's own device: cpu, and cuda marked `cuda` (skipped without one); it samples float32 logits on both
DEVICES = [pytest.param(d.name, id=d.name, marks=CUDA_MARKS if d is CUDA else ()) for d in (CPU, CUDA)]


def row(params: SP, token_ids=(), num_output_tokens: int = 0, step_key: int | None = None,
        top: int = 0) -> SamplingRow:
    ids = list(token_ids)
    return SamplingRow(params, ids, num_output_tokens, len(ids) if step_key is None else step_key, top)


def rand_logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def hf_filtered(logits: torch.Tensor, p: SP) -> torch.Tensor:
    """transformers' warpers, in generate()'s order, on one row [1, V]."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    x = TemperatureLogitsWarper(float(p.temperature))(ids, logits.clone())
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if 0.0 < p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x


# A spread of per-row filter settings, all mixed in one batch.
FILTER_PARAMS = [
    SP(temperature=1.0, top_k=5),
    SP(temperature=0.7, top_p=0.8),
    SP(temperature=1.3, min_p=0.1),
    SP(temperature=0.9, top_k=20, top_p=0.9),
    SP(temperature=0.5, top_p=0.5, min_p=0.2),
    SP(temperature=2.0, top_k=40, top_p=0.95, min_p=0.05),
    SP(temperature=1.0, top_k=1),
    SP(temperature=1.0, top_p=0.01),
    SP(temperature=1.0, top_k=1000),  # larger than the vocabulary
    SP(temperature=1.0),
    SP(temperature=1.0, top_p=1.0),  # off
]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_of_raw(device):
    logits = rand_logits(8, 300).to(device)
    out = Sampler(300).sample(logits, [row(SP(), [1, 2, 3]) for _ in range(8)])
    assert out.token_ids.device.type == device
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_follows_bias_and_repetition_penalty(device):
    logits = rand_logits(3, 50, seed=1)
    top = logits.argmax(-1)
    prompt = [int(top[1]), 7, 7, 9]
    rows = [
        row(SP(logit_bias={3: 100.0})),
        row(SP(repetition_penalty=1e4), prompt),
        row(SP(logit_bias={int(top[2]): -100.0})),
    ]
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[1:2] = RepetitionPenaltyLogitsProcessor(1e4)(torch.tensor([prompt]), logits[1:2].clone())
    expected[2, top[2]] -= 100.0
    sampler = Sampler(50)
    assert torch.allclose(sampler.process_logits(logits.to(device), rows).cpu(), expected)
    out = sampler.sample(logits.to(device), rows)
    assert out.token_ids.tolist() == expected.argmax(-1).tolist()
    assert out.token_ids[0] == 3 and out.token_ids[1] != top[1] and out.token_ids[2] != top[2]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_and_batch_independent(device):
    v = 1000
    logits = rand_logits(6, v, seed=2, scale=1.0).to(device)
    seeded = [
        row(SP(temperature=1.0, seed=11), range(5)),
        row(SP(temperature=0.8, top_p=0.9, seed=2**64 - 1), range(9)),
        row(SP(temperature=1.2, top_k=50, min_p=0.01, seed=0), range(3), step_key=123456789012),
    ]
    others = [row(SP()), row(SP(temperature=1.0, top_k=3, repetition_penalty=1.3), [1, 2]), row(SP(temperature=0.5))]
    sampler = Sampler(v)
    first = sampler.sample(logits[:3], seeded).token_ids.tolist()
    assert sampler.sample(logits[:3], seeded).token_ids.tolist() == first
    assert Sampler(v).sample(logits[:3], seeded).token_ids.tolist() == first  # a fresh sampler agrees
    for i, r in enumerate(seeded):  # alone, and at another position in a mixed batch
        assert sampler.sample(logits[i : i + 1], [r]).token_ids.tolist() == [first[i]]
        batch = others[:i] + [r] + others[i:]
        mixed = torch.cat([logits[3 : 3 + i], logits[i : i + 1], logits[3 + i :]])
        assert sampler.sample(mixed, batch).token_ids[i].item() == first[i]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_cpu_and_cuda_draw_the_same_tokens(device):
    v, n = 500, 2000
    logits = rand_logits(1, v, seed=3, scale=1.0).expand(n, v).contiguous()
    rows = [row(SP(temperature=1.0, top_p=0.9, min_p=0.01, seed=5), step_key=k) for k in range(n)]
    cpu = Sampler(v).sample(logits, rows).token_ids
    gpu = Sampler(v).sample(logits.cuda(), rows).token_ids.cpu()
    assert torch.equal(cpu, gpu)


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_and_steps_draw_differently(device):
    v, n = 64, 400
    logits = torch.zeros(n, v, device=device)  # uniform: any two independent draws agree with p = 1/64
    sampler = Sampler(v)
    def draw(seed_step) -> torch.Tensor:
        return sampler.sample(logits, [row(SP(temperature=1.0, seed=sd), step_key=k) for sd, k in seed_step]).token_ids

    by_step = draw((7, k) for k in range(n))
    by_seed = draw((s, 3) for s in range(n))
    by_high_half = draw((s << 32, 3) for s in range(n))
    for draws in (by_step, by_seed, by_high_half):
        assert len(set(draws.tolist())) > 50  # 400 uniform draws over 64 tokens cover nearly all
    assert (by_step != by_seed).float().mean() > 0.9
    assert (by_seed != by_high_half).float().mean() > 0.9
    unseeded = [row(SP(temperature=1.0), step_key=3) for _ in range(n)]
    a, b = sampler.sample(logits, unseeded).token_ids, sampler.sample(logits, unseeded).token_ids
    assert (a != b).float().mean() > 0.9  # a fresh seed per call


# The CPU's top-p shortcuts (topk candidates, 2 forcing the widening loop), and the device path run on CPU.
PATHS = ["host", "host-widening", "device-path"]


def use_path(path: str, monkeypatch) -> None:
    if path == "host-widening":
        monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES", 2)
    if path == "device-path":
        monkeypatch.setattr(sampler_mod, "_on_host", lambda t: False)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("device", DEVICES)
def test_filters_keep_the_same_tokens_as_transformers(device, path, monkeypatch):
    use_path(path, monkeypatch)
    v = 200
    logits = rand_logits(len(FILTER_PARAMS), v, seed=4)
    sampler = Sampler(v)
    mine = sampler.filtered_logits(logits.to(device), [row(p) for p in FILTER_PARAMS]).cpu()
    for i, p in enumerate(FILTER_PARAMS):
        ref = hf_filtered(logits[i : i + 1], p)[0]
        assert torch.equal(torch.isfinite(mine[i]), torch.isfinite(ref)), p
        assert torch.allclose(mine[i][torch.isfinite(ref)], ref[torch.isfinite(ref)]), p


@pytest.mark.parametrize("device", DEVICES)
def test_filtered_tokens_are_never_drawn(device):
    v, n = 100, 2000
    sampler = Sampler(v)
    for j, p in enumerate(FILTER_PARAMS[:8]):
        logits = rand_logits(1, v, seed=10 + j, scale=1.5)
        ref = hf_filtered(logits, p)[0]
        allowed = set(torch.nonzero(torch.isfinite(ref)).flatten().tolist())
        rows = [row(SP(**{**vars(p), "seed": 99}), step_key=k) for k in range(n)]
        drawn = sampler.sample(logits.expand(n, v).to(device), rows).token_ids.tolist()
        assert set(drawn) <= allowed, p
        likely = set(torch.nonzero(torch.softmax(ref, -1) > 0.01).flatten().tolist())
        assert likely <= set(drawn), p  # every token with p > 1% shows up in 2000 draws


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
    p = SP(temperature=1.0, top_k=2)
    mine = Sampler(6).filtered_logits(logits, [row(p)])
    assert torch.equal(torch.isfinite(mine), torch.isfinite(hf_filtered(logits, p)))
    assert torch.isfinite(mine).sum() == 4  # 3.0 and the three tied 2.0s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [SP(temperature=0.7, seed=1), SP(temperature=1.5, top_p=0.8, top_k=12, seed=2)])
def test_empirical_distribution_matches_softmax(device, params):
    v, n = 20, 20000
    logits = rand_logits(1, v, seed=5, scale=1.0)
    target = torch.softmax(hf_filtered(logits, params), -1)[0]
    rows = [row(params, step_key=k) for k in range(n)]
    drawn = Sampler(v).sample(logits.expand(n, v).to(device), rows).token_ids.cpu()
    freq = torch.bincount(drawn, minlength=v).float() / n
    assert 0.5 * (freq - target).abs().sum() < 0.05


def test_mixed_greedy_and_sampled_rows():
    v = 300
    logits = rand_logits(4, v, seed=6)
    rows = [row(SP()), row(SP(temperature=1.0, seed=1)), row(SP(logit_bias={5: 100.0})),
            row(SP(temperature=0.5, top_p=0.5))]
    out = Sampler(v).sample(logits, rows)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == 5


@pytest.mark.parametrize("device", DEVICES)
def test_repetition_penalty_matches_transformers(device):
    v = 40
    logits = rand_logits(3, v, seed=7)
    ids = torch.tensor([[1, 2, 2, 39, 0], [5, 6, 7, 8, 5], [1, 2, 3, 4, 5]])
    pens = [1.5, 0.7, 0.0]  # the last row is off
    rows = [row(SP(repetition_penalty=p), ids[i].tolist(), num_output_tokens=2) for i, p in enumerate(pens)]
    mine = Sampler(v).process_logits(logits.to(device), rows).cpu()
    for i, p in enumerate(pens):
        ref = logits[i : i + 1].clone()
        if p != 0.0:
            ref = RepetitionPenaltyLogitsProcessor(p)(ids[i : i + 1], ref)
        assert torch.equal(mine[i], ref[0])


@pytest.mark.parametrize("device", DEVICES)
def test_presence_and_frequency_count_only_output_tokens(device):
    v = 30
    logits = rand_logits(2, v, seed=8)
    prompt, output = [3, 3, 4, 9], [4, 4, 4, 5, 9]
    rows = [
        row(SP(presence_penalty=0.5, frequency_penalty=0.25), prompt + output, num_output_tokens=len(output)),
        row(SP(presence_penalty=-1.0), prompt, num_output_tokens=0),  # no output yet: nothing changes
    ]
    mine = Sampler(v).process_logits(logits.to(device), rows).cpu()
    expected = logits.clone()
    for tok, count in {4: 3, 5: 1, 9: 1}.items():
        expected[0, tok] -= 0.25 * count + 0.5
    assert torch.allclose(mine, expected)
    assert mine[0, 3] == logits[0, 3]  # prompt-only token untouched


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    v = 500
    logits = rand_logits(4, v, seed=9).to(device)
    rows = [
        row(SP(temperature=0.3, top_k=3, logit_bias={0: 50.0}, seed=1), top=5),
        row(SP(), top=0),
        row(SP(repetition_penalty=2.0), [1, 2, 3], top=2),
        row(SP(temperature=1.0, seed=2), top=1),
    ]
    out = Sampler(v).sample(logits, rows)
    ref = torch.log_softmax(logits.float(), -1)
    assert torch.equal(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    ref_vals, ref_ids = ref.topk(5, -1)
    assert torch.equal(out.top_token_ids, ref_ids) and torch.equal(out.top_logprobs, ref_vals)
    lists = out.to_lists()
    assert [len(r.top) for r in lists] == [5, 0, 2, 1]
    assert lists[0].token_id == 0  # the bias decides the token, not its reported logprob
    assert lists[0].logprob == pytest.approx(ref[0, 0].item())
    assert lists[2].top == [(int(ref_ids[2, j]), ref_vals[2, j].item()) for j in range(2)]
    assert out.top_logprobs.dtype == torch.float32 and out.top_token_ids.dtype == torch.int64


def test_no_top_logprobs_and_half_precision_logits():
    logits = rand_logits(2, 64, seed=10).to(torch.bfloat16)
    out = Sampler(64).sample(logits, [row(SP()), row(SP(temperature=1.0, top_p=0.9))])
    assert out.top_token_ids.shape == (2, 0) and out.logprobs.dtype == torch.float32
    assert out.token_ids[0] == logits[0].float().argmax()


def test_padded_vocab_columns_are_never_drawn():
    logits = torch.zeros(1000, 12)
    logits[:, 10:] = 50.0  # padding columns past vocab_size
    rows = [row(SP(temperature=1.0, seed=1), step_key=k) for k in range(1000)]
    assert Sampler(10).sample(logits, rows).token_ids.max() < 10
    assert Sampler(10).sample(logits[:1], [row(SP())]).token_ids.item() < 10


def test_hash_in_place_matches_reference_and_is_pinned():
    x = torch.randint(0, 2**32, (4, 1000))
    assert torch.equal(_mix32_(x.clone()), _mix32(x))
    assert [_mix32(int(a)) for a in x[0, :20]] == _mix32(x[0, :20]).tolist()
    # Pinned: changing the scheme changes every seeded request's tokens; do it knowingly.
    assert row_key(0, 0) == PINNED_ROW_KEY_0_0
    assert row_key(2**64 - 1, 2**40 + 3) == PINNED_ROW_KEY_MAX


PINNED_ROW_KEY_0_0 = 1935939301
PINNED_ROW_KEY_MAX = 1385793283


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(top_k=-1), dict(top_p=1.5), dict(min_p=-0.1),
    dict(repetition_penalty=-1.0), dict(presence_penalty=2.5), dict(frequency_penalty=math.inf),
    dict(seed=-1), dict(seed=2**64), dict(logit_bias={100: 1.0}), dict(logit_bias={1: 101.0}),
    dict(logit_bias={1: math.nan}),
])
def test_validate_rejects_bad_values(bad):
    with pytest.raises(InvalidRequest):
        SP(**bad).validate(vocab_size=100)


def test_validate_accepts_edges():
    SP(temperature=0.0, top_p=1.0, min_p=1.0, repetition_penalty=1.0, presence_penalty=-2.0, seed=2**64 - 1,
       logit_bias={0: -100.0, 99: 100.0}).validate(vocab_size=100)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("probs, top_p, kept", [
    ([0.5, 0.25, 0.125, 0.125], 0.75, [0, 1]),  # exact cumulative sums: the "<= 1 - top_p" boundary
    ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.875, [0, 1, 2]),
    ([0.125, 0.25, 0.25, 0.25, 0.125], 0.5, [1, 2]),  # three tied at the cut: TopP keeps two; the lowest ids
    ([0.25, 0.25, 0.25, 0.25], 0.01, [0]),
])
@pytest.mark.parametrize("path", PATHS)
def test_top_p_boundaries_and_ties(device, probs, top_p, kept, path, monkeypatch):
    use_path(path, monkeypatch)
    logits = torch.tensor([probs]).log()
    p = SP(temperature=1.0, top_p=top_p)
    mine = torch.isfinite(Sampler(len(probs)).filtered_logits(logits.to(device), [row(p)])[0].cpu())
    assert torch.nonzero(mine).flatten().tolist() == kept
    assert mine.sum() == torch.isfinite(hf_filtered(logits, p)).sum()


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_boundary(device):
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    p = SP(temperature=1.0, min_p=0.5)  # 0.25 is exactly min_p * 0.5: kept, as MinP keeps "not <"
    mine = torch.isfinite(Sampler(4).filtered_logits(logits.to(device), [row(p)])[0].cpu())
    assert mine.tolist() == [True, True, False, False]
    assert torch.equal(mine, torch.isfinite(hf_filtered(logits, p)[0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30, 9e-6])
def test_tiny_temperature_is_greedy(device, temperature):
    """A subnormal (or tiny) temperature used to overflow the scaled logits to inf and pick the lowest id of
    the tied infinities; below GREEDY_TEMPERATURE it is greedy, with filters, seeds and bias as greedy has
    them (bias and penalties apply; filters and the draw do not)."""
    logits = rand_logits(4, 300, seed=3, scale=20.0).to(device)
    logits[:, 0] = -5.0  # the lowest id is never the argmax
    s = Sampler(300)
    params = SP(temperature=temperature, top_k=50, top_p=0.9, seed=11, logit_bias={7: 3.0})
    got = s.sample(logits, [row(params, step_key=k) for k in range(4)]).token_ids.tolist()
    want = s.sample(logits, [row(SP(logit_bias={7: 3.0}), step_key=k) for k in range(4)]).token_ids.tolist()
    assert got == want == s.process_logits(logits, [row(SP(logit_bias={7: 3.0}))] * 4).argmax(-1).tolist()
    assert SP(temperature=temperature).is_greedy and not SP(temperature=1e-5).is_greedy
