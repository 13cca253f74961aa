"""The executor's features over weights kept in GGUF blocks (a Q8_0 file of the tiny Llama, served on its
blocks): LoRA adapters (float, over the quantized base), prefix-cache reuse, speculative drafts and a preempted
sequence's recompute each give what the same executor gives without them, or what the file served with
--gguf-dequantize gives within the logits tolerance of tests/models/test_gguf_blocks.py; tensor parallelism cuts
the blocks as it cuts float weights (TP=2 through real processes equals TP=1); the flags that cannot run block
weights are refused naming --gguf-dequantize."""
from __future__ import annotations

import pytest
import torch

from executor_service.types import UnifiedItem
from models.decode.native import NativeDecode
from models.loader import load_model
from models.parallel.shard import Shard, shard_model
from models.quant.blocks import BlockWeight, block_weights
from tests.executor.test_deterministic_kernels import GREEDY, run as det_run
from tests.executor.test_executor_parity import prompt_of
from tests.executor.test_speculative_verify import assert_pool_whole, plain_run, spec_run
from tests.executor.test_tensor_parallel import ARGS, HEADS, LocalStub, _compare, run_scenario
from tests.executor_driver import create_cache, greedy_run, make_executor, prefill_prompt, raising, warm_prefixes
from tests.grpc_harness import start_executor
from tests.gguf_files import write_gguf
from tests.lora_fixtures import make_peft_adapter
from tests.models.test_gguf_blocks import LOGITS_TOLERANCE, logits_error
from tests.models.test_gguf_checkpoint import WIDE

# Within one executor, a row's numbers are the same (to float rounding) whichever path computes it: the kernel
# in decode-sized calls, dequantized blocks in larger ones with the activations rounded as the kernel rounds them
# (models/quant/blocks.py). Drafts of 2-9 tokens take both paths.
SAME_EXECUTOR_TOL = 1e-3
DRAFTS = [("half", 2), ("right", 9), ("wrong", 2), ("half", 6)]


@pytest.fixture(scope="module")
def gguf(model_dir, tmp_path_factory):
    path, _ = write_gguf(model_dir, tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf", "Q8_0")
    return path


@pytest.fixture(scope="module")
def ex(gguf):
    ex = make_executor(gguf, kv_blocks=64)
    assert ex.info().quantization == "gguf-blocks:Q8_0"
    return ex


def test_lora_over_block_weights(gguf, model_dir, tmp_path):
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=8, alpha=16, seed=1)
    kw = dict(kv_blocks=64, adapter_root=tmp_path, adapters=(("a", adapter),))
    blocks, floats = make_executor(gguf, **kw), make_executor(gguf, gguf_dequantize=True, **kw)
    prompt = prompt_of(21, seed=2)
    _, tokens, logits = greedy_run(blocks, prompt, 8, adapter="a")
    _, want_tokens, want_logits = greedy_run(floats, prompt, 8, adapter="a")
    same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
    assert same >= 2 and logits_error(logits[:same + 1], want_logits[:same + 1]) < LOGITS_TOLERANCE
    assert tokens != greedy_run(blocks, prompt, 8)[1]  # the adapter is applied


def test_drafts_over_block_weights(ex):
    prompt = prompt_of(19, seed=4)
    ref = plain_run(ex, prompt, 16)
    got = spec_run(ex, prompt, ref, DRAFTS)
    assert got.tokens == ref.tokens
    assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < SAME_EXECUTOR_TOL
    assert_pool_whole(ex)


def test_prefix_reuse_over_block_weights(ex):
    prompt = prompt_of(40, seed=5)
    fresh_id, fresh, _ = greedy_run(ex, prompt, 4)
    ex.release_cache([fresh_id])
    warm_prefixes(ex, [prompt])
    cache_id, cached = create_cache(ex, prompt)
    assert cached == 32
    (r,) = raising(ex.unified_decode([UnifiedItem(tuple(prompt[cached:]), cache_id, cached)]))
    assert r.output.tokens[0].token_id == fresh[0]
    ex.release_cache([cache_id])
    assert_pool_whole(ex)


def test_preempted_sequence_recomputes_the_same(ex):
    """Released after 10 tokens, then prompt + those tokens recomputed in chunks of 9 (prefill: the dequantized
    path) and decoded on: the continuation is the uninterrupted run's."""
    prompt = prompt_of(30, seed=3)
    cache_id, want, want_logits = greedy_run(ex, prompt, 16)
    ex.release_cache([cache_id])
    resumed = prompt + want[:10]
    cache_id, _, out = prefill_prompt(ex, resumed, chunk=9)
    assert out.tokens[0].token_id == want[10]
    assert logits_error([out.logits[0]], [want_logits[10]]) < SAME_EXECUTOR_TOL
    ex.release_cache([cache_id])
    assert_pool_whole(ex)


def test_native_step_over_blocks_equals_the_eager_forward(gguf, ex):
    """The native decode step reads the blocks in place (models/native/blocks.h): what it decodes is what the
    eager forward over the same blocks decodes (the same kernel per linear layer; attention sums in another
    order)."""
    assert isinstance(ex.decode_step, NativeDecode)  # auto: the native step runs block weights
    eager = make_executor(gguf, kv_blocks=64, decode_kernel="torch")
    assert eager.decode_step is None
    prompt = prompt_of(25, seed=6)
    _, tokens, logits = greedy_run(ex, prompt, 12)
    _, want_tokens, want_logits = greedy_run(eager, prompt, 12)
    assert tokens == want_tokens
    assert logits_error(logits, want_logits) < SAME_EXECUTOR_TOL


def test_deterministic_over_blocks_is_bitwise_the_same_however_batched_or_chunked(gguf):
    """--deterministic runs every row through the native step, whose block kernel quantizes each row's
    activations on its own and sums each output in block order: a run is the same bits whole, in chunks of 3,
    or beside other sequences."""
    det = make_executor(gguf, kv_blocks=128, deterministic=True)
    prompt = prompt_of(23, seed=7)
    want = det_run(det, prompt, GREEDY)
    assert det_run(det, prompt, GREEDY, chunk=3) == want
    assert det_run(det, prompt, GREEDY, others=2) == want


@pytest.mark.parametrize("flags, named", [(dict(compile=True), "--compile")])
def test_flags_that_cannot_run_blocks_are_refused_naming_the_way_out(gguf, flags, named):
    with pytest.raises(ValueError) as exc:
        make_executor(gguf, **flags)
    assert str(exc.value).startswith(named) and "block formats (Q8_0)" in str(exc.value)
    assert "--gguf-dequantize" in str(exc.value)


@pytest.fixture(scope="module")
def gguf_tp(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama with 8 heads / 4 KV heads in Q8_0: each of 2 ranks gets 32 of o_proj's 64 inputs."""
    path, _ = write_gguf(tiny_checkpoint("llama", config_overrides=HEADS),
                         tmp_path_factory.mktemp("gguf-tp") / "tiny-tp-Q8_0.gguf", "Q8_0")
    return path


def test_tensor_parallel_shards_cut_the_blocks_as_the_float_weights(gguf_tp):
    for rank in range(2):
        blocks, floats = load_model(gguf_tp, progress=False), load_model(gguf_tp, progress=False, gguf_dequantize=True)
        shard_model(blocks, Shard(rank=rank, size=2))
        shard_model(floats, Shard(rank=rank, size=2))
        cut = dict(blocks.named_modules())
        for name, f in floats.named_modules():
            w = getattr(cut[name], "quant", None) or getattr(cut[name], "blocks", None)
            if isinstance(w, BlockWeight):
                assert torch.equal(w.dequantized(), f.weight), (rank, name)
                assert tuple(cut[name].weight.shape) == tuple(f.weight.shape)
                assert (w.bias is None) == (getattr(f, "bias", None) is None)
        assert blocks.lm_head.quant is blocks.model.embed_tokens.blocks  # tied: the shard's own rows


def test_tp2_on_blocks_equals_tp1(gguf_tp):
    with start_executor(gguf_tp, *ARGS, "--tensor-parallel-size", "2") as server:
        got = run_scenario(server.stub)
    _compare(got, run_scenario(LocalStub(gguf_tp)))


def test_tensor_parallelism_refuses_cutting_inside_blocks(tiny_checkpoint, tmp_path):
    """Q4_K blocks hold 256 weights: 2 ranks' 128 of o_proj's 256 inputs would cut them."""
    path, _ = write_gguf(tiny_checkpoint("llama", config_overrides=WIDE), tmp_path / "k.gguf", "Q4_K")
    with pytest.raises(ValueError, match="would cut blocks; pass --gguf-dequantize"):
        shard_model(load_model(path, progress=False), Shard(rank=0, size=2))


@pytest.fixture(scope="module")
def gguf_q4(model_dir, tmp_path_factory):
    path, _ = write_gguf(model_dir, tmp_path_factory.mktemp("gguf-q4") / "tiny-Q4_0.gguf", "Q4_0")
    return path


@pytest.mark.parametrize("file, name", [("gguf_q4", "Q4_0"), ("gguf", "Q8_0")])
def test_repacked_rows_in_the_native_step_the_eager_forward_and_deterministic(file, name, request):
    """Q4_0 and Q8_0 rows are repacked 8 by 8 at load (models/native/blocks_x8.h, blocks_q8_0x8.h): the native
    step decodes what the eager forward decodes over them, and --deterministic stays the same bits however batched
    or chunked (a group of 8 rows is computed whole whichever thread's rows it meets, each activation row on its
    own)."""
    path = request.getfixturevalue(file)
    ex = make_executor(path, kv_blocks=64)
    formats = [fmt for w in block_weights(ex.model) for fmt, _ in w.parts]
    assert any(fmt.name == name for fmt in formats) and all(fmt.interleave == 8 for fmt in formats if fmt.name == name)
    assert isinstance(ex.decode_step, NativeDecode)
    eager = make_executor(path, kv_blocks=64, decode_kernel="torch")
    prompt = prompt_of(25, seed=6)
    _, tokens, logits = greedy_run(ex, prompt, 12)
    _, want_tokens, want_logits = greedy_run(eager, prompt, 12)
    assert tokens == want_tokens and logits_error(logits, want_logits) < SAME_EXECUTOR_TOL
    det = make_executor(path, kv_blocks=128, deterministic=True)
    prompt = prompt_of(23, seed=7)
    want = det_run(det, prompt, GREEDY)
    assert det_run(det, prompt, GREEDY, chunk=3) == want
    assert det_run(det, prompt, GREEDY, others=2) == want
