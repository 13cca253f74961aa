"""Pooled items on the in-process Executor (executor_service/step/pooling.py) against transformers on the same
weights: last-token and mean embeddings (mean over chunks, the cache's running sum), a classification head
(Qwen2ForSequenceClassification), chosen tokens' logits; pooled items beside a sampled one in one forward
(whose token is unchanged); the checks (mean pooling after a reused prefix, a sampled item on a model without
an LM head, bad token ids, classify without a head) and GetInfo's pooling facts. On each device (tests/devices.py):
float32 on the CPU, bfloat16 on CUDA within its tolerance of the CPU float32 reference (tests/device_tolerances.py:
an embedding's cosine, a head's logits as logits)."""
from __future__ import annotations

import pytest
import torch
import transformers

from executor_service.types import PoolingOptions, PoolingTask, PoolingType, UnifiedItem
from tandem import capabilities as caps
from tandem.errors import CacheStateConflict, InvalidRequest
from tests.conftest import built_once
from tests.device_tolerances import assert_greedy_token, assert_logits_close
from tests.executor_driver import LOGITS, create_cache, make_executor, raising
from tests.pooling_checkpoints import make_classifier, make_mean_embedder

PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58], [1, 70, 71, 72, 73]]
EMBED_LAST = PoolingOptions(PoolingTask.EMBED, PoolingType.LAST, normalize=True)
EMBED_MEAN = PoolingOptions(PoolingTask.EMBED, PoolingType.MEAN, normalize=True)


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return built_once(tmp_path_factory, "pooling", "qwen2-classifier-1", lambda out: make_classifier(out))


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    return built_once(tmp_path_factory, "pooling", "qwen3-st-mean", make_mean_embedder)


def hidden_states(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) of every position: [n, hidden]."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def classifier_reference(model_dir, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' classification scores [labels] and, per label, how far a score may move in bfloat16: the
    scores project the last hidden state h (after the final norm) on the head's rows w, so a hidden state
    within a relative L2 error e of the reference's (the cosine tolerance's premise) moves a score by at most
    e |w| |h| (Cauchy-Schwarz). A few labels have no largest logit of a vocabulary to be relative to."""
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], ref.score.weight.norm(dim=-1) * out.hidden_states[-1][0, -1].norm()


def assert_scores_close(got: torch.Tensor, want: torch.Tensor, reach: torch.Tensor, device) -> None:
    if device.exact:
        assert torch.allclose(got, want, atol=1e-4), (got, want)
    else:
        assert ((got.float() - want).abs() <= device.tol.logits * reach).all(), (got, want, reach)


def test_last_and_mean_embeddings_equal_transformers_beside_a_sampled_item(qwen3, device):
    ex = make_executor(qwen3, device=device)
    alone = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[1]), output=LOGITS)]))[0].output.logits[0]
    items = [UnifiedItem(tuple(PROMPTS[0]), pooling=EMBED_LAST), UnifiedItem(tuple(PROMPTS[0]), pooling=EMBED_MEAN),
             UnifiedItem(tuple(PROMPTS[1]))]
    last, mean, sampled = raising(ex.unified_decode(items))
    assert last.output is None and mean.output is None and sampled.pooled is None
    # the pooled items changed nothing of it (float32: its token; bfloat16: up to a near tie of the batch's shape)
    assert_greedy_token(sampled.output.tokens[0].token_id, alone, device.dtype, "beside pooled items")
    ref = hidden_states(qwen3, PROMPTS[0])
    assert cosine(last.pooled, ref[-1]) >= device.tol.cosine and abs(float(last.pooled.norm()) - 1) < 1e-5
    assert cosine(mean.pooled, ref.mean(0)) >= device.tol.cosine
    assert ex.info().pooling.default_type is PoolingType.LAST and caps.POOLING in ex.info().capabilities


def test_mean_pooling_over_chunks_keeps_a_running_sum(embedder_dir, device):
    ex = make_executor(embedder_dir, device=device)
    info = ex.info().pooling
    assert info.default_type is PoolingType.MEAN and info.matryoshka and info.matryoshka_dimensions == (16, 32)
    default = PoolingOptions(PoolingTask.EMBED, None, normalize=False)  # the checkpoint's: mean
    first = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[0][:7]), is_final_chunk=False, pooling=default)]))
    cid = first[0].cache.cache_id
    second = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[0][7:]), cid, 7, pooling=default)]))[0]
    ref = hidden_states(embedder_dir, PROMPTS[0]).mean(0)
    assert cosine(second.pooled, ref) >= device.tol.cosine
    if device.exact:
        assert torch.allclose(second.pooled, ref, atol=1e-4)
    else:  # not normalized: the size too, element by element as logits are
        assert_logits_close(second.pooled.float(), ref, device.dtype, "the mean")


def test_mean_pooling_after_a_reused_prefix_fails_alone(embedder_dir, device):
    ex = make_executor(embedder_dir, device=device)
    raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[0]), pooling=EMBED_LAST)]))  # caches its first block
    cid, cached = create_cache(ex, PROMPTS[0])
    assert cached == 16
    (res,) = ex.unified_decode([UnifiedItem(tuple(PROMPTS[0][cached:]), cid, cached, pooling=EMBED_MEAN)])
    assert isinstance(res.error, CacheStateConflict) and "every position" in str(res.error)
    (res,) = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[0][cached:]), cid, cached, pooling=EMBED_LAST)]))
    assert cosine(res.pooled, hidden_states(embedder_dir, PROMPTS[0])[-1]) >= device.tol.cosine  # reuse is fine


def test_classification_head_and_token_logits_equal_transformers(classifier_dir, qwen3, device):
    ex = make_executor(classifier_dir, device=device)
    info = ex.info()
    assert info.architecture == "Qwen2ForSequenceClassification" and info.pooling.num_labels == 1
    assert not info.pooling.lm_head
    (res,) = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[1]), pooling=PoolingOptions(PoolingTask.CLASSIFY))]))
    assert_scores_close(res.pooled, *classifier_reference(classifier_dir, PROMPTS[1]), device)
    (sampled,) = ex.unified_decode([UnifiedItem(tuple(PROMPTS[1]))])
    assert isinstance(sampled.error, InvalidRequest) and "no LM head" in str(sampled.error)
    (logits,) = ex.unified_decode([UnifiedItem(tuple(PROMPTS[1]), pooling=PoolingOptions(
        PoolingTask.TOKEN_LOGITS, token_ids=(5,)))])
    assert isinstance(logits.error, InvalidRequest)

    lm = make_executor(qwen3, device=device)
    (tl,) = raising(lm.unified_decode([UnifiedItem(tuple(PROMPTS[1]), pooling=PoolingOptions(
        PoolingTask.TOKEN_LOGITS, token_ids=(9, 4)))]))
    causal = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        full = causal(torch.tensor([PROMPTS[1]])).logits[0, -1]
    if device.exact:
        assert torch.allclose(tl.pooled, full[[9, 4]], atol=1e-4)
    else:  # two of the row's logits, within the logits' bound (relative to the row's largest |logit|)
        assert float((tl.pooled - full[[9, 4]]).abs().max()) <= device.tol.logits * float(full.abs().max())
    bad = lm.unified_decode([UnifiedItem(tuple(PROMPTS[1]), pooling=PoolingOptions(PoolingTask.CLASSIFY)),
                             UnifiedItem(tuple(PROMPTS[1]), pooling=PoolingOptions(PoolingTask.TOKEN_LOGITS,
                                                                                   token_ids=(10**6,))),
                             UnifiedItem(tuple(PROMPTS[1]), pooling=EMBED_LAST, draft_token_ids=(3,))])
    assert ["classification head" in str(bad[0].error), "outside the vocabulary" in str(bad[1].error),
            "samples nothing" in str(bad[2].error)] == [True, True, True]




def test_the_pooling_flag_overrides_the_checkpoint(embedder_dir):
    """--pooling last on a sentence-transformers folder that says mean."""
    info = make_executor(embedder_dir, pooling="last").info().pooling
    assert info.default_type is PoolingType.LAST and info.source == "--pooling last"


def test_llama_sequence_classifier_equals_transformers(tmp_path_factory, device):
    model_dir = built_once(tmp_path_factory, "pooling", "llama-classifier-2",
                           lambda out: make_classifier(out, "llama", num_labels=2))
    ex = make_executor(model_dir, device=device)
    (res,) = raising(ex.unified_decode([UnifiedItem(tuple(PROMPTS[0]), pooling=PoolingOptions(PoolingTask.CLASSIFY))]))
    assert res.pooled.shape == (2,)
    assert_scores_close(res.pooled, *classifier_reference(model_dir, PROMPTS[0]), device)
