"""Speculative decoding in the executor: draft tokens (UnifiedItem / DecodeItem.draft_token_ids)
verified inside the batch's forward, on tiny fp32 checkpoints in process.

The drafts are ORACLE drafts: the tokens a run without drafts produced, sent all right, right for a prefix
then wrong, or wrong from the first. Since the output with drafts must equal the output without them, how
many drafts each step accepts is then known exactly, and so are the cache's length, its blocks and the
pool's free blocks after every rollback. Covered: greedy (several prompts, k from 1 to the 32 limit, top
logprobs), a batch mixing drafting and plain decodes with prompt chunks and new caches, drafts on a cache's
first chunk (also after a reused prefix), LoRA, Qwen3-MoE, seeded sampling with every processor (identical
tokens), a chi-square test that the sampled distribution is the target one (seeded and unseeded), and the
validation of drafts (per item, Decode, a KV pool too small for them).

On each device (tests/devices.py), but in float32 on CUDA too: the oracle needs the run with drafts to equal
the run without them token for token, which bfloat16 cannot promise (a draft is verified in a multi-token forward,
a plain step replays a CUDA graph: another order of rounding flips the tiny models' near ties, and the exact
acceptance counts and KV accounting with it). What CUDA adds is the device's own path: verification and rollback
over a pool on the GPU, beside graphed decode steps. The MoE and chi-square tests, and the validation ones with
an executor of their own, run on the CPU."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from executor_service.rpc import codec
from executor_service.in_process_client import InProcessExecutorClient
from executor_service.request_validation import MAX_DRAFT_TOKENS
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem
from models.sampler import Sampler, SamplingRow
from tandem.ceil_div import ceil_div
from tandem.errors import InvalidRequest, KvCapacityExceeded, SequenceTooLong
from tandem.executor.v1 import executor_pb2 as pb
from tandem.sampling_params import SamplingParams
from tests.executor_driver import create_cache, make_executor, raising, warm_prefixes
from tests.hf_reference import rel_err
from tests.lora_fixtures import make_peft_adapter

BS = 16  # the executor's default block size
STEPS = 40
LOGPROB_TOL = 1e-4
WITH_LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


PROMPTS = [prompt_of(5, 1), prompt_of(19, 2), prompt_of(37, 3)]

# Draft schedules, cycled step by step: (kind, k). "right": the k next tokens of the run without drafts;
# "half": its first k // 2 tokens, then wrong ones; "wrong": wrong from the first draft.
SCHEDULES = {
    "right": [("right", 1), ("right", 4), ("right", MAX_DRAFT_TOKENS)],
    "half": [("half", 2), ("half", 9), ("half", MAX_DRAFT_TOKENS)],
    "wrong": [("wrong", 1), ("wrong", 5), ("wrong", MAX_DRAFT_TOKENS)],
    "mixed": [("right", 3), ("wrong", 2), ("half", 6), ("right", MAX_DRAFT_TOKENS), ("half", 17), ("wrong", 9)],
}


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    free_at: dict[int, int] = field(default_factory=dict)  # cache length -> the pool's free blocks then
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when the output mode has them
    drafted: int = 0
    accepted: int = 0

    def take(self, tokens, logits: torch.Tensor | None = None) -> None:
        if logits is not None:
            self.logits.append(logits[0])
        for t in tokens:
            self.tokens.append(t.token_id)
            self.logprobs.append(t.logprob)
            self.tops.append(list(t.top_logprobs))


def wrong(token: int, vocab: int) -> int:
    return (token + 1) % vocab


def oracle_drafts(kind: str, k: int, ref: list[int], m: int, vocab: int) -> tuple[tuple[int, ...], int]:
    """k drafts for the position of ref[m] on, and how many of them must be accepted."""
    right = {"right": k, "half": k // 2, "wrong": 0}[kind]
    drafts = [t if j < right else wrong(t, vocab) for j, t in enumerate(ref[m:m + k])]
    return tuple(drafts), right


def cache_blocks(ex, cache_id: str) -> int:
    return next(c.blocks for s in ex.list_caches() for c in s.caches if c.cache_id == cache_id)


def assert_pool_whole(ex) -> None:
    usage = ex.kv_usage()
    assert (usage.free_blocks, usage.active_caches) == (usage.total_blocks, 0)


def plain_run(ex, prompt: list[int], steps: int, sampling: SamplingParams | None = None, adapter: str = "",
              output: OutputOptions = OutputOptions()) -> Run:
    """The reference: the prompt as a new cache, then one token per call (no drafts)."""
    run = Run()
    (r,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt), sampling=sampling, output=output, adapter=adapter)]))
    cache_id = r.cache.cache_id
    while True:
        run.free_at[r.cache.seq_len] = ex.kv_usage().free_blocks
        run.take(r.output.tokens, r.output.logits)
        if len(run.tokens) == steps:
            break
        (r,) = raising(ex.unified_decode([UnifiedItem((run.tokens[-1],), cache_id, r.cache.seq_len, output=output,
                                                      adapter=adapter)]))
    ex.release_cache([cache_id])
    return run


def spec_run(ex, prompt: list[int], ref: Run, schedule: list[tuple[str, int]], sampling: SamplingParams | None = None,
             adapter: str = "", output: OutputOptions = OutputOptions()) -> Run:
    """The same sequence with oracle drafts from ref (the prompt's item carries drafts too). Checks
    after every call: the output is the accepted drafts + one token, the cache length is old + tokens +
    accepted, the cache holds exactly the blocks for that length, and the pool has exactly the free blocks
    the run without drafts had at that length. Releases the cache and checks the pool is whole."""
    vocab = ex.model_config.vocab_size
    steps = len(ref.tokens)
    run, cache_id, length = Run(), None, 0
    for kind, k in itertools.cycle(schedule):
        m = len(run.tokens)
        room = steps - m - 1  # never past the reference's length
        drafts, want = oracle_drafts(kind, min(k, room), ref.tokens, m, vocab) if room else ((), 0)
        tokens = tuple(prompt) if cache_id is None else (run.tokens[-1],)
        (r,) = raising(ex.unified_decode([UnifiedItem(tokens, cache_id, length, True, sampling, output, adapter,
                                                      draft_token_ids=drafts)]))
        assert len(r.output.tokens) == want + 1, (kind, k, m)
        assert r.cache.seq_len == length + len(tokens) + want
        cache_id, length = r.cache.cache_id, r.cache.seq_len
        assert cache_blocks(ex, cache_id) == ceil_div(length, BS)
        assert ex.kv_usage().free_blocks == ref.free_at[length], f"after step {m}: KV blocks leaked or lost"
        run.take(r.output.tokens)
        run.drafted, run.accepted = run.drafted + len(drafts), run.accepted + want
        if len(run.tokens) == steps:
            break
    ex.release_cache([cache_id])
    assert_pool_whole(ex)
    return run


def assert_same(got: Run, ref: Run, tops: bool = False) -> None:
    assert got.tokens == ref.tokens
    worst = max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs))
    assert worst < LOGPROB_TOL, worst
    if tops:
        for g, w in zip(got.tops, ref.tops):
            assert [t for t, _ in g] == [t for t, _ in w] and len(g) > 0
            assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def shared_ex(model_dir, device):
    """float32 on every device (the module's docstring says why)."""
    return make_executor(model_dir, kv_blocks=64, device=device, dtype="float32")


@pytest.fixture
def ex(shared_ex):
    """The module's executor; whatever a test leaves behind (a failed one) is released after it."""
    yield shared_ex
    shared_ex.release_cache([c.cache_id for s in shared_ex.list_caches() for c in s.caches])


@pytest.fixture(scope="module")
def refs(shared_ex) -> dict[int, Run]:
    return {n: plain_run(shared_ex, p, STEPS) for n, p in enumerate(PROMPTS)}


# ------------------------------------------------------------------ greedy parity and exact KV accounting


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("n", range(len(PROMPTS)))
def test_greedy_with_oracle_drafts_equals_without(ex, refs, n, schedule):
    got = spec_run(ex, PROMPTS[n], refs[n], SCHEDULES[schedule])
    assert_same(got, refs[n])
    assert got.drafted > 0
    if schedule == "right":
        assert got.accepted == got.drafted
    elif schedule == "wrong":
        assert got.accepted == 0


def test_top_logprobs_of_accepted_drafts(ex):
    """Every returned token, accepted draft or not, carries its own top-N alternatives."""
    out = OutputOptions(top_logprobs=3)
    ref = plain_run(ex, PROMPTS[1], 24, output=out)
    assert_same(spec_run(ex, PROMPTS[1], ref, SCHEDULES["mixed"], output=out), ref, tops=True)


def test_mixed_batch_every_item_as_alone(ex, refs):
    """One unified_decode per step carrying drafting decodes (all right / half right), a plain decode, the
    chunks of a long prompt (non-final ones beside the drafts, the final one with drafts) and new caches
    (one of them with drafts on its prompt): every sequence equals its run alone, token for token."""
    vocab = ex.model_config.vocab_size
    long_prompt = prompt_of(70, 9)
    seqs = [  # prompt, first step, prompt chunk (None: whole), draft schedule (None: no drafts), reference
        dict(prompt=PROMPTS[0], start=0, chunk=None, schedule=SCHEDULES["right"], ref=refs[0]),
        dict(prompt=PROMPTS[1], start=0, chunk=None, schedule=SCHEDULES["half"], ref=refs[1]),
        # a plain decode wanting logits after two drafting items: its logit rows are found past theirs
        dict(prompt=PROMPTS[2], start=0, chunk=None, schedule=None, output=WITH_LOGITS,
             ref=plain_run(ex, PROMPTS[2], 24, output=WITH_LOGITS)),
        dict(prompt=long_prompt, start=1, chunk=16, schedule=SCHEDULES["mixed"], ref=plain_run(ex, long_prompt, 24)),
        dict(prompt=PROMPTS[2][::-1], start=3, chunk=None, schedule=SCHEDULES["half"],
             ref=plain_run(ex, PROMPTS[2][::-1], 24)),
    ]
    for s in seqs:
        s.update(cache=None, fed=0, length=0, run=Run(), plan=itertools.cycle(s["schedule"] or [("right", 0)]))
    kinds_per_call = []
    for step in itertools.count():
        live = [s for s in seqs if step >= s["start"] and len(s["run"].tokens) < len(s["ref"].tokens)]
        if not live:
            break
        items, wants, kinds = [], [], set()
        for s in live:
            run, ref, prompt = s["run"], s["ref"].tokens, s["prompt"]
            if s["fed"] < len(prompt):
                part = prompt[s["fed"]:s["fed"] + (s["chunk"] or len(prompt))]
                final = s["fed"] + len(part) == len(prompt)
            else:
                part, final = [run.tokens[-1]], True
            drafts, want = (), 0
            if final and s["schedule"]:
                kind, k = next(s["plan"])
                drafts, want = oracle_drafts(kind, min(k, len(ref) - len(run.tokens) - 1), ref, len(run.tokens), vocab)
            kinds.add("new" if s["cache"] is None else "chunk" if not final else
                      "draft" if drafts and s["fed"] == len(prompt) else "decode" if not drafts else "prompt+draft")
            items.append(UnifiedItem(tuple(part), s["cache"], s["length"], final,
                                     output=s.get("output", OutputOptions()), draft_token_ids=drafts))
            wants.append(want)
        kinds_per_call.append(kinds)
        for s, item, want, r in zip(live, items, wants, raising(ex.unified_decode(items))):
            assert r.cache.seq_len == s["length"] + len(item.token_ids) + want
            s["cache"], s["length"] = r.cache.cache_id, r.cache.seq_len
            if s["fed"] < len(s["prompt"]):
                s["fed"] += len(item.token_ids)
            if item.is_final_chunk:
                assert len(r.output.tokens) == want + 1
                s["run"].take(r.output.tokens, r.output.logits)
            else:
                assert r.output is None
        if step == 1:  # the long prompt's first chunk made its cache
            assert any(s["cache"] for s in seqs if s["chunk"])
    assert any({"draft", "decode", "chunk", "new"} <= k for k in kinds_per_call), kinds_per_call
    assert any("prompt+draft" in k for k in kinds_per_call)
    for n, s in enumerate(seqs):
        assert s["run"].tokens == s["ref"].tokens, f"sequence {n}"
        assert max(abs(a - b) for a, b in zip(s["run"].logprobs, s["ref"].logprobs)) < LOGPROB_TOL
    got, want = seqs[2]["run"].logits, seqs[2]["ref"].logits
    assert len(got) == len(want) == 24 and max(rel_err(g, w) for g, w in zip(got, want)) < LOGPROB_TOL
    ex.release_cache([s["cache"] for s in seqs])
    assert_pool_whole(ex)


def test_a_logits_only_item_before_a_drafting_one(ex, refs):
    """Logit rows that are not sampled (output mode logits) come first in the call: the drafting item's
    acceptance still reads its own sampled rows, and the logits are the item's alone."""
    prompt, ref = PROMPTS[1], refs[1]
    (alone,) = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[0]), output=WITH_LOGITS)]))
    drafts, want = oracle_drafts("half", 6, ref.tokens, 0, ex.model_config.vocab_size)
    only, drafting = raising(ex.unified_decode([
        UnifiedItem(tuple(PROMPTS[0]), output=OutputOptions(OutputMode.LOGITS)),
        UnifiedItem(tuple(prompt), draft_token_ids=drafts)]))
    assert not only.output.tokens and rel_err(only.output.logits[0], alone.output.logits[0]) < LOGPROB_TOL
    assert [t.token_id for t in drafting.output.tokens] == ref.tokens[:want + 1]
    assert drafting.cache.seq_len == len(prompt) + want
    ex.release_cache([alone.cache.cache_id, only.cache.cache_id, drafting.cache.cache_id])
    assert_pool_whole(ex)


@pytest.mark.parametrize("kind", ["right", "half", "wrong"])
def test_drafts_on_a_new_caches_prompt(ex, refs, kind):
    """A new cache whose first (final) chunk carries drafts: prefill and verification in one forward."""
    vocab = ex.model_config.vocab_size
    prompt, ref = PROMPTS[1], refs[1]
    for k in (1, 7, MAX_DRAFT_TOKENS):
        drafts, want = oracle_drafts(kind, k, ref.tokens, 0, vocab)
        (r,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt), draft_token_ids=drafts)]))
        assert [t.token_id for t in r.output.tokens] == ref.tokens[:want + 1]
        assert r.cache.seq_len == len(prompt) + want and cache_blocks(ex, r.cache.cache_id) == ceil_div(
            len(prompt) + want, BS)
        # the cache goes on as if the accepted drafts had come one step at a time
        (d,) = raising(ex.unified_decode([UnifiedItem((ref.tokens[want],), r.cache.cache_id, r.cache.seq_len)]))
        assert d.output.tokens[0].token_id == ref.tokens[want + 1]
        ex.release_cache([r.cache.cache_id])
    assert_pool_whole(ex)


def test_drafts_after_a_reused_prefix(model_dir, device):
    """A cache created over a cached prefix (its blocks shared with the prefix cache), whose remaining prompt
    carries drafts: the rejected drafts' rollback never touches the shared blocks."""
    ex = make_executor(model_dir, kv_blocks=64, device=device, dtype="float32")
    prompt = prompt_of(40, 5)
    ref = plain_run(ex, prompt, 12)
    warm_prefixes(ex, [prompt])
    cache_id, cached = create_cache(ex, prompt)
    assert cached == 32
    drafts, want = oracle_drafts("half", 8, ref.tokens, 0, ex.model_config.vocab_size)
    (r,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt[cached:]), cache_id, cached, draft_token_ids=drafts)]))
    assert [t.token_id for t in r.output.tokens] == ref.tokens[:want + 1] and r.cache.seq_len == 40 + want
    ex.release_cache([cache_id])
    # the shared blocks still hold the prompt's KV: a second reuse answers the same
    cache_id, _ = create_cache(ex, prompt)
    (r,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt[cached:]), cache_id, cached)]))
    assert r.output.tokens[0].token_id == ref.tokens[0]
    ex.release_cache([cache_id])
    assert_pool_whole(ex)


def test_drafts_into_a_shared_block_write_a_private_copy(model_dir, device):
    """A cache cut back into a block it shares with another cache (both reuse a cached prefix), then fed a
    token with drafts that are rejected: the writes and the rollback go to its own copy of the block; the
    other cache still continues exactly as the reference."""
    ex = make_executor(model_dir, kv_blocks=64, device=device, dtype="float32")
    prompt = prompt_of(40, 5)
    ref = plain_run(ex, prompt, 6)  # its released blocks stay cached (prefix caching)
    (cut_ref,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt[:21]))]))
    ex.release_cache([cut_ref.cache.cache_id])
    holder, _ = create_cache(ex, prompt)
    other, cached = create_cache(ex, prompt)
    assert cached == 32 and cache_blocks(ex, holder) == cache_blocks(ex, other) == 2
    assert ex.truncate_cache(other, 20).seq_len == 20  # its last block: shared, cut inside
    vocab = ex.model_config.vocab_size
    drafts = tuple(wrong(cut_ref.output.tokens[0].token_id, vocab) for _ in range(14))  # positions 21..34
    (r,) = raising(ex.unified_decode([UnifiedItem((prompt[20],), other, 20, draft_token_ids=drafts)]))
    assert [t.token_id for t in r.output.tokens] == [cut_ref.output.tokens[0].token_id] and r.cache.seq_len == 21
    assert cache_blocks(ex, other) == 2
    (h,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt[32:]), holder, 32)]))  # the shared block intact
    assert h.output.tokens[0].token_id == ref.tokens[0]
    ex.release_cache([holder, other])
    assert_pool_whole(ex)


# ------------------------------------------------------------------ LoRA and MoE


def test_lora_with_drafts_equals_without(model_dir, tmp_path, device):
    pytest.importorskip("peft", reason="the adapter is written with peft (a lent GPU's bundle may lack it)")
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=8, alpha=16, seed=1)
    ex = make_executor(model_dir, kv_blocks=64, adapter_root=tmp_path, adapters=(("a", adapter),), device=device,
                       dtype="float32")
    prompt = PROMPTS[1]
    ref = plain_run(ex, prompt, 24, adapter="a")
    assert ref.tokens != plain_run(ex, prompt, 24).tokens  # the adapter is applied
    for schedule in ("right", "half", "wrong"):
        assert_same(spec_run(ex, prompt, ref, SCHEDULES[schedule], adapter="a"), ref)


def test_qwen3_moe_with_drafts_equals_without(tiny_checkpoint):
    ex = make_executor(tiny_checkpoint("qwen3_moe"), kv_blocks=64)
    for prompt in PROMPTS[1:]:
        ref = plain_run(ex, prompt, 24)
        for schedule in ("mixed", "half"):
            assert_same(spec_run(ex, prompt, ref, SCHEDULES[schedule]), ref)


# ------------------------------------------------------------------ sampling


SAMPLING = SamplingParams(temperature=0.9, top_k=60, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.6,
                          frequency_penalty=0.4, seed=1234, logit_bias={7: 2.5, 100: -100.0, 221: 1.5})


@pytest.fixture(scope="module")
def sampled_refs(shared_ex, refs) -> dict[int, Run]:
    out = {n: plain_run(shared_ex, p, STEPS, sampling=SAMPLING) for n, p in enumerate(PROMPTS[:2])}
    assert all(out[n].tokens != refs[n].tokens for n in out)  # it really samples
    return out


@pytest.mark.parametrize("schedule", ["right", "half", "mixed"])
def test_seeded_sampling_with_processors_is_reproducible(ex, sampled_refs, schedule):
    """Every processor (bias, repetition / presence / frequency penalties over the history before that
    position, temperature, top-k, top-p) and the position's RNG key apply at every drafted position: the
    seeded output with oracle drafts is the output without drafts, token for token."""
    for n, ref in sampled_refs.items():
        got = spec_run(ex, PROMPTS[n], ref, SCHEDULES[schedule], sampling=SAMPLING)
        assert_same(got, ref)
        assert got.accepted > 0


def test_penalties_see_only_the_tokens_before_each_drafted_position(ex):
    """A repeated draft where the repetition penalty decides: with the penalty over the whole row (drafts
    after the position included) the greedy choice would change. Seeded greedy + penalties: each accepted
    token is the one the run without drafts chose."""
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)
    prompt = PROMPTS[0]
    ref = plain_run(ex, prompt, 24, sampling=params)
    for schedule in ("right", "half"):
        assert_same(spec_run(ex, prompt, ref, SCHEDULES[schedule], sampling=params), ref)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): sf(1) = erfc(sqrt(x/2)), sf(2) = exp(-x/2), and
    sf(df + 2) = sf(df) + (x/2)^(df/2) exp(-x/2) / Gamma(df/2 + 1) (exact; no scipy needed)."""
    sf, k = (math.erfc(math.sqrt(x / 2)), 1) if df % 2 else (math.exp(-x / 2), 2)
    while k < df:
        sf += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1)) if x > 0 else 0.0
        k += 2
    return sf


def test_chi2_sf_matches_the_tables():
    for x, df, p in [(3.841459, 1, 0.05), (18.307038, 10, 0.05), (44.263225, 15, 1e-4), (31.827628, 8, 1e-4),
                     (24.995790, 15, 0.05), (34.169607, 20, 0.025)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=1e-4)


def chi_square(observed: dict[tuple[int, int], int], expected: dict[tuple[int, int], float]) -> tuple[float, int]:
    """The statistic and degrees of freedom over cells pooled so that each expects >= 5 draws."""
    cells = sorted(expected, key=expected.get)
    groups: list[list[tuple[int, int]]] = []
    pool: list[tuple[int, int]] = []
    for c in cells:
        pool.append(c)
        if sum(expected[p] for p in pool) >= 5:
            groups.append(pool)
            pool = []
    if pool:  # the leftover small cells join the next-smallest group
        groups[0] += pool
    stat = 0.0
    for g in groups:
        e, o = sum(expected[c] for c in g), sum(observed.get(c, 0) for c in g)
        stat += (o - e) ** 2 / e
    return stat, len(groups) - 1


class TargetDistribution:
    """The exact distribution of the first two sampled tokens without speculation: softmax of the sampler's
    filtered logits (temperature, top-k) after the prompt, and after the prompt + each possible first token."""

    def __init__(self, ex, prompt: list[int], params: SamplingParams) -> None:
        sampler = Sampler(ex.model_config.vocab_size)

        def probs(tokens: list[int]) -> torch.Tensor:
            (r,) = raising(ex.unified_decode([UnifiedItem(tuple(tokens), output=WITH_LOGITS)]))
            ex.release_cache([r.cache.cache_id])
            row = SamplingRow(params, tokens, 0, len(tokens))
            return torch.softmax(sampler.filtered_logits(r.output.logits, [row]), dim=-1)[0].double()

        self.first = probs(prompt)
        self.support = [int(t) for t in torch.nonzero(self.first).flatten()]
        self.second = {t: probs(prompt + [t]) for t in self.support}

    def joint(self) -> dict[tuple[int, int], float]:
        return {(a, int(b)): float(self.first[a] * self.second[a][b])
                for a in self.support for b in torch.nonzero(self.second[a]).flatten()}


def sample_pairs(ex, prompt: list[int], drafts: tuple[int, int], n: int, seeded: bool,
                 batch: int = 250) -> tuple[dict[tuple[int, int], int], list[int]]:
    """n draws of the first two tokens, each from a new cache given the prompt + the two drafts (many items
    per call). Where the first draft was rejected the second token comes from one more (plain) step.
    Returns the counts of (token 1, token 2) and how many drafts each draw accepted."""
    counts: dict[tuple[int, int], int] = {}
    accepted: list[int] = []
    for lo in range(0, n, batch):
        items = [UnifiedItem(tuple(prompt), sampling=SamplingParams(temperature=1.0, top_k=4,
                                                                   seed=i if seeded else None),
                             draft_token_ids=drafts) for i in range(lo, min(n, lo + batch))]
        results = raising(ex.unified_decode(items))
        more = [(r.cache.cache_id, r.output.tokens[0].token_id) for r in results if len(r.output.tokens) == 1]
        seconds = iter(raising(ex.unified_decode([UnifiedItem((t,), c, len(prompt)) for c, t in more])) if more else [])
        for r in results:
            toks = [t.token_id for t in r.output.tokens]
            accepted.append(len(toks) - 1)
            assert r.cache.seq_len == len(prompt) + len(toks) - 1
            if len(toks) == 1:
                toks.append(next(seconds).output.tokens[0].token_id)
            counts[(toks[0], toks[1])] = counts.get((toks[0], toks[1]), 0) + 1
        ex.release_cache([r.cache.cache_id for r in results])
        assert_pool_whole(ex)
    return counts, accepted


# A repetitive prompt (chosen among a few): the tiny Llama's top-4 after it is spread out (p 0.18 to 0.34), and
# the likeliest first token is also likely after itself.
STAT_PROMPT = [171, 32, 13, 171, 32, 13, 171, 32]


@pytest.mark.parametrize("seeded, p_min", [(True, 1e-4), (False, 1e-6)], ids=["seeded", "unseeded"])
def test_sampled_distribution_with_drafts_is_the_target(model_dir, seeded, p_min):
    """Speculative sampling is exact: with drafts d1, d2 (likely tokens, so draws accept both, one or none)
    the joint distribution of the first two tokens over 2000 draws (temperature 1, top-k 4) passes a
    chi-square test against the model's exact distribution. Seeded (seeds 0..1999: a fixed outcome, p >= 1e-4)
    and unseeded (the sampler's own randomness: fails wrongly with probability 1e-6)."""
    ex = make_executor(model_dir, kv_blocks=300)
    params = SamplingParams(temperature=1.0, top_k=4)
    target = TargetDistribution(ex, STAT_PROMPT, params)
    # d1: the first token's likeliest value, d2: the likeliest after it; both far from sure things, and the
    # two positions' top-k sets share tokens (d2 = d1 here), so draws of one row leaking into the next
    # (e.g. both rows keyed alike) would bias the joint distribution.
    d1 = max(target.support, key=lambda t: target.first[t])
    d2 = int(target.second[d1].argmax())
    assert 0.2 < target.first[d1] < 0.8 and 0.2 < target.second[d1][d2] < 0.8, "pick another prompt"
    assert target.second[d1][d1] > 0.1
    counts, accepted = sample_pairs(ex, STAT_PROMPT, (d1, d2), 2000, seeded)
    expected = {cell: 2000 * p for cell, p in target.joint().items()}
    assert set(counts) <= set(expected), "a token outside top-k was drawn"
    assert all(accepted.count(a) > 100 for a in (0, 1, 2)), [accepted.count(a) for a in (0, 1, 2)]
    stat, df = chi_square(counts, expected)
    assert df >= 6
    assert chi2_sf(stat, df) > p_min, (stat, df, counts, expected)
    # the acceptance rates themselves are the target's probabilities of the drafts (within 5 sigma)
    p1, p12 = float(target.first[d1]), float(target.first[d1] * target.second[d1][d2])
    for got, p in ((sum(a >= 1 for a in accepted), p1), (accepted.count(2), p12)):
        assert abs(got - 2000 * p) < 5 * math.sqrt(2000 * p * (1 - p)), (got, p)


# ------------------------------------------------------------------ validation


def test_bad_drafts_fail_their_item_alone(ex, refs):
    vocab, max_len = ex.model_config.vocab_size, ex.info().max_seq_len
    prompt, ref = PROMPTS[1], refs[1]
    (a,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt))]))
    (b,) = raising(ex.unified_decode([UnifiedItem((3,) * (max_len - 4))]))
    free = ex.kv_usage().free_blocks
    good_drafts = tuple(ref.tokens[1:5])
    results = ex.unified_decode([
        UnifiedItem(tuple(prompt[:8]), None, 0, False, draft_token_ids=(5,)),  # a non-final chunk
        UnifiedItem(tuple(prompt), draft_token_ids=(5,) * (MAX_DRAFT_TOKENS + 1)),  # too many
        UnifiedItem(tuple(prompt), output=WITH_LOGITS, draft_token_ids=(5,)),  # logits per position
        UnifiedItem(tuple(prompt), output=OutputOptions(OutputMode.LOGITS), draft_token_ids=(5,)),
        UnifiedItem(tuple(prompt), draft_token_ids=(5, vocab)),  # an id outside the vocabulary
        UnifiedItem((3,), b.cache.cache_id, max_len - 4, draft_token_ids=(3, 3, 3, 3)),  # past max_len
        UnifiedItem((ref.tokens[0],), a.cache.cache_id, len(prompt), draft_token_ids=good_drafts),  # fine
    ])
    kinds = [type(r.error) if r.error else None for r in results]
    assert kinds == [InvalidRequest] * 5 + [SequenceTooLong, None]
    messages = [str(r.error) for r in results[:6]]
    assert "final chunk" in messages[0] and str(MAX_DRAFT_TOKENS) in messages[1]
    assert "output mode must be tokens" in messages[2] and "output mode must be tokens" in messages[3]
    assert f"token id {vocab}" in messages[4] and "4 draft tokens" in messages[5]
    assert all(messages[n].startswith(f"item {n}") for n in range(6))
    assert [t.token_id for t in results[6].output.tokens] == ref.tokens[1:6]  # all 4 accepted, then one more
    assert results[6].cache.seq_len == len(prompt) + 5
    assert ex.cache_length(b.cache.cache_id) == max_len - 4  # the failed item wrote nothing
    assert ex.kv_usage().free_blocks == free and ex.kv_usage().active_caches == 2
    # exactly at max_len is allowed: 3 drafts, then the sampled token
    (r,) = raising(ex.unified_decode([UnifiedItem((3,), b.cache.cache_id, max_len - 4, draft_token_ids=(3, 3, 3))]))
    assert r.cache.seq_len <= max_len
    ex.release_cache([a.cache.cache_id, b.cache.cache_id])
    assert_pool_whole(ex)


def test_draft_statuses_through_the_grpc_codec(ex, refs):
    """The wire form: draft_token_ids in UnifiedItem, per-item INVALID_ARGUMENT / OUT_OF_RANGE, and the
    accepted tokens in the result's output."""
    client = InProcessExecutorClient(ex)
    prompt, ref, max_len = PROMPTS[1], refs[1], ex.info().max_seq_len
    assert "speculative_drafts" in client.info_now().capabilities
    resp = client.unified_decode_now([
        pb.UnifiedItem(token_ids=prompt, is_final_chunk=True, draft_token_ids=ref.tokens[:3]),
        pb.UnifiedItem(token_ids=prompt, is_final_chunk=False, draft_token_ids=[5]),
        pb.UnifiedItem(token_ids=[3] * (max_len - 1), is_final_chunk=True, draft_token_ids=[3, 3]),
    ])
    codes = [r.status.code for r in resp.results]
    assert codes == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.OUT_OF_RANGE.value[0]]
    assert [t.token_id for t in resp.results[0].output.tokens] == ref.tokens[:4]
    assert resp.results[0].cache.seq_len == len(prompt) + 3
    client.release_now([resp.results[0].cache.cache_id])
    assert_pool_whole(ex)
    item, _ = codec.decode_item_from_pb(pb.DecodeItem(cache=pb.CacheRef(cache_id="c", seq_len=3), token_id=5,
                                                      draft_token_ids=[7, 8]))
    assert item.draft_token_ids == (7, 8)  # Decode's items carry them too


def test_decode_with_drafts(ex, refs):
    """Decode takes drafts with num_steps 1 (answers as UnifiedDecode does); with num_steps > 1 the item
    fails INVALID_ARGUMENT alone while the others take their steps."""
    prompt, ref = PROMPTS[1], refs[1]
    drafts, want = oracle_drafts("half", 6, ref.tokens, 1, ex.model_config.vocab_size)
    caches = [raising(ex.unified_decode([UnifiedItem(tuple(prompt))]))[0].cache.cache_id for _ in range(3)]
    (u,) = raising(ex.unified_decode([UnifiedItem((ref.tokens[0],), caches[0], len(prompt), draft_token_ids=drafts)]))
    (d,) = raising(ex.decode([DecodeItem(CacheRef(caches[1], len(prompt)), ref.tokens[0], draft_token_ids=drafts)]))
    assert [t.token_id for t in d.output.tokens] == [t.token_id for t in u.output.tokens] == ref.tokens[1:want + 2]
    assert d.cache.seq_len == u.cache.seq_len == len(prompt) + 1 + want
    assert max(abs(a.logprob - b.logprob) for a, b in zip(d.output.tokens, u.output.tokens)) < LOGPROB_TOL
    results = ex.decode([DecodeItem(CacheRef(caches[2], len(prompt)), ref.tokens[0], draft_token_ids=drafts),
                         DecodeItem(CacheRef(caches[0], u.cache.seq_len), ref.tokens[want + 1])], num_steps=3)
    assert isinstance(results[0].error, InvalidRequest) and "num_steps" in str(results[0].error)
    assert ex.cache_length(caches[2]) == len(prompt)
    assert [t.token_id for t in results[1].output.tokens] == ref.tokens[want + 2:want + 5]
    ex.release_cache(caches)
    assert_pool_whole(ex)


def test_drafts_count_against_max_batch_tokens(model_dir):
    ex = make_executor(model_dir, kv_blocks=16, max_batch_tokens=24)
    with pytest.raises(InvalidRequest, match="draft tokens included"):
        ex.unified_decode([UnifiedItem((3,) * 20, draft_token_ids=(4,) * 5)])
    assert_pool_whole(ex)
    (r,) = raising(ex.unified_decode([UnifiedItem((3,) * 20, draft_token_ids=(4,) * 4)]))
    assert r.output.tokens


def test_a_pool_too_small_for_the_drafts_changes_nothing(model_dir):
    """Drafts need KV slots up front: a call whose drafts do not fit raises KvCapacityExceeded with every cache
    as it was (length, tokens, blocks); the same step without drafts then runs and equals the reference."""
    ex = make_executor(model_dir, kv_blocks=3)
    prompt = prompt_of(31, 7)  # 2 blocks; one free
    ref = plain_run(ex, prompt, 6)
    (r,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt))]))
    cache_id = r.cache.cache_id
    free = ex.kv_usage().free_blocks
    assert free == 1
    with pytest.raises(KvCapacityExceeded):  # 31 + 1 + 20 tokens need 4 blocks
        ex.unified_decode([UnifiedItem((ref.tokens[0],), cache_id, 31,
                                       draft_token_ids=tuple(ref.tokens[1:6]) + (5,) * 15)])
    assert ex.cache_length(cache_id) == 31 and cache_blocks(ex, cache_id) == 2 and ex.kv_usage().free_blocks == 1
    # the cache's tokens are unchanged too: drafts that fit now give exactly the reference
    (r,) = raising(ex.unified_decode([UnifiedItem((ref.tokens[0],), cache_id, 31,
                                                  draft_token_ids=tuple(ref.tokens[1:5]))]))
    assert [t.token_id for t in r.output.tokens] == ref.tokens[1:6] and r.cache.seq_len == 36
    ex.release_cache([cache_id])
    assert_pool_whole(ex)
