"""The executor's draft model (--draft-model) in process, on tiny fp32 checkpoints of one tokenizer: items with
model_draft_tokens give exactly the tokens (and logprobs) of plain decoding, whatever the guesses (another random
model's, mostly wrong); the draft cache keeps what the served cache kept; a full draft pool evicts the least
recently used draft cache and recomputes it later; drafts shrink to the served pool's room instead of failing the
call; released caches and closed sessions free their draft caches; the validation of model_draft_tokens; and a draft
model of another vocabulary or tokenizer refused at start, naming why."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.types import OutputMode, OutputOptions, UnifiedItem
from tandem.errors import InvalidRequest
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


@pytest.fixture(scope="module")
def other_draft(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=7, num_layers=1)


@pytest.fixture(scope="module")
def plain(model_dir):
    return make_executor(model_dir, kv_blocks=64)


@pytest.fixture(scope="module")
def drafting(model_dir, other_draft):
    return make_executor(model_dir, kv_blocks=64, draft_model=other_draft, draft_kv_blocks=32)


def decode(ex: Executor, prompt: list[int], steps: int, n: int, sampling: SamplingParams | None = None,
           top: int = 0) -> tuple[list[int], list[float], int, str]:
    """Tokens, logprobs, draft tokens verified, cache id: `steps` tokens or more, each step asking n model drafts."""
    out = OutputOptions(OutputMode.TOKENS, top)
    (r,) = ex.unified_decode([UnifiedItem(tuple(prompt), sampling=sampling, output=out, model_draft_tokens=n)])
    assert r.error is None, r.error
    tokens, logprobs, drafted = [t.token_id for t in r.output.tokens], [t.logprob for t in r.output.tokens], 0
    drafted += r.model_draft_tokens
    while len(tokens) < steps:
        (r,) = ex.unified_decode([UnifiedItem((tokens[-1],), r.cache.cache_id, r.cache.seq_len, output=out,
                                              model_draft_tokens=n)])
        assert r.error is None, r.error
        assert len(r.output.tokens) <= r.model_draft_tokens + 1
        tokens += [t.token_id for t in r.output.tokens]
        logprobs += [t.logprob for t in r.output.tokens]
        drafted += r.model_draft_tokens
    return tokens[:steps], logprobs[:steps], drafted, r.cache.cache_id


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_k=30, seed=5, presence_penalty=0.4)],
                         ids=["greedy", "seeded"])
def test_model_drafts_change_no_token(plain, drafting, sampling):
    p = prompt_of(17, 1)
    want, want_lp, _, a = decode(plain, p, 30, 0, sampling, top=2)
    got, got_lp, drafted, b = decode(drafting, p, 30, 5, sampling, top=2)
    assert got == want and got_lp == pytest.approx(want_lp, abs=1e-4)
    assert drafted > 0
    # the draft cache holds what the served cache kept (its tokens, the accepted guesses), nothing rejected
    state = drafting._store.view("").get(b)
    dc = drafting.draft._caches[id(state)]
    assert dc.state.tokens == state.tokens[:len(dc.state.tokens)] and dc.state.table.length == len(dc.state.tokens)
    before = drafting.info().draft_model
    drafting.release_cache([b])
    plain.release_cache([a])
    after = drafting.info().draft_model
    assert after.live_caches == before.live_caches - 1 and after.caches_freed == before.caches_freed + 1
    assert after.draft_tokens >= drafted and after.accepted_draft_tokens < after.draft_tokens  # (another model)


def test_full_draft_pool_evicts_the_least_recently_used(model_dir):
    ex = make_executor(model_dir, kv_blocks=64, draft_model=model_dir, draft_kv_blocks=2)  # 32 draft slots
    sid = ex.open_session("test").session_id
    a, b = prompt_of(10, 2), prompt_of(18, 3)
    (ra,) = ex.unified_decode([UnifiedItem(tuple(a), model_draft_tokens=3)], sid)  # 10 + 2 guesses: 1 block
    (rb,) = ex.unified_decode([UnifiedItem(tuple(b), model_draft_tokens=3)], sid)  # 18 + 2: 2 blocks, A evicted
    info = ex.info().draft_model
    assert ra.model_draft_tokens == rb.model_draft_tokens == 3
    assert (info.caches_evicted, info.live_caches, info.free_blocks) == (1, 1, 0)
    catch_up = info.catch_up_tokens
    next_a = ra.output.tokens[-1].token_id
    (ra2,) = ex.unified_decode([UnifiedItem((next_a,), ra.cache.cache_id, ra.cache.seq_len, model_draft_tokens=3)],
                               sid)
    info = ex.info().draft_model
    assert ra2.model_draft_tokens == 3 and info.caches_evicted == 2  # B out, A recomputed from its tokens
    assert info.catch_up_tokens - catch_up == ra.cache.seq_len + 1
    # A sequence longer than the whole pool: no drafts, the item runs
    (rc,) = ex.unified_decode([UnifiedItem(tuple(prompt_of(40, 4)), model_draft_tokens=3)], sid)
    assert rc.error is None and rc.model_draft_tokens == 0 and len(rc.output.tokens) == 1
    assert ex.info().draft_model.items_without_drafts == 1
    assert ex.close_session(sid) == 3  # its caches released, and their draft caches with them
    assert ex.info().draft_model.live_caches == 0


def test_drafts_shrink_to_the_served_pools_room(model_dir):
    ex = make_executor(model_dir, kv_blocks=2, draft_model=model_dir)  # 32 slots for the served model
    (r,) = ex.unified_decode([UnifiedItem(tuple(prompt_of(30, 5)), model_draft_tokens=8)])
    assert r.error is None and r.model_draft_tokens == 2  # positions 30, 31: the rest of the second block
    assert len(r.output.tokens) == 3  # (its own model: both guesses right)


def test_validation(plain, drafting):
    cases = [(plain, UnifiedItem((5, 6), model_draft_tokens=2), "--draft-model"),
             (drafting, UnifiedItem((5, 6), model_draft_tokens=33), "at most 32"),
             (drafting, UnifiedItem((5, 6), is_final_chunk=False, model_draft_tokens=2), "final chunk"),
             (drafting, UnifiedItem((5, 6), draft_token_ids=(7,), model_draft_tokens=2), "exclude each other"),
             (drafting, UnifiedItem((5, 6), output=OutputOptions(OutputMode.LOGITS), model_draft_tokens=2),
              "output mode"),
             (drafting, UnifiedItem((5, 6), prompt_logprobs=1, model_draft_tokens=2), "prompt_logprobs")]
    for ex, item, words in cases:
        (r,) = ex.unified_decode([item])
        assert isinstance(r.error, InvalidRequest) and words in str(r.error), (item, r.error)
    assert "draft_model" in drafting.info().capabilities and "draft_model" not in plain.info().capabilities


def test_draft_model_of_another_vocabulary_is_refused(model_dir, tiny_checkpoint, tmp_path):
    wider = tiny_checkpoint("llama", seed=3, num_layers=1, config_overrides={"vocab_size": 1024})
    with pytest.raises(ValueError, match=r"--draft-model .*: its vocabulary has 1024 tokens, the served model's 448"):
        Executor(ExecutorConfig(model_dir, device="cpu", kv_blocks=16, progress=False, draft_model=wider))
    swapped = tmp_path / "swapped"  # the same weights and size, two tokens' ids exchanged
    shutil.copytree(model_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    x, y = list(vocab)[100:102]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer maps 2 tokens to other ids"):
        Executor(ExecutorConfig(model_dir, device="cpu", kv_blocks=16, progress=False, draft_model=swapped))
