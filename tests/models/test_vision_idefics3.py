"""Idefics3 (SmolVLM's architecture) in process: the scheduler's numpy/Pillow image processor and placeholder
text against transformers' own (PIL) processor, and the executor's vision tower + Llama text tower against
transformers' Idefics3ForConditionalGeneration on the same image and text: logits, greedy tokens, chunked prefill
with a chunk boundary inside the image's tokens, the embedding cache, and prefix-cache keys by image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_service.types import CreateCacheItem, DecodeItem, CacheRef, ImageInput, OutputMode, OutputOptions, UnifiedItem
from scheduler.text.tokenizer import ModelTokenizer
from scheduler.vision.chat_images import ChatImages
from scheduler.vision.media_policy import MediaPolicy
from tests.executor_driver import make_executor, raising
from tests.hf_reference import rel_err
from tests.vision_harness import chat_prompt
from tests.vision_checkpoints import image_processor_class, noise_image, vision_checkpoint

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)
SIZES = [(20, 24), (50, 70), (90, 40), (64, 64)]  # one tile; split 2x3 / 3x2 / 2x2 (+ the global tile)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    proc = Idefics3Processor(image_processor=image_processor_class().from_pretrained(ckpt), tokenizer=tok,
                             image_seq_len=4)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(ckpt).eval()
    return proc, model


@pytest.fixture(scope="module")
def ours(ckpt):
    return ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt)


@pytest.fixture(scope="module")
def ex(ckpt):
    return make_executor(ckpt)


def _prompt(ours, images, text="Describe the fish."):
    return chat_prompt(ours, images, text)


def _hf_inputs(hf, images, text="Describe the fish."):
    proc, _ = hf
    prompt = "<|im_start|>user\n" + "<image>" * len(images) + text + "<|im_end|>\n<|im_start|>assistant\n"
    return proc(images=[list(images)], text=prompt, return_tensors="pt")


@pytest.mark.parametrize("size,mode", [(s, "RGB") for s in SIZES] + [((50, 70), "RGBA"), ((30, 33), "L")])
def test_processor_matches_transformers(hf, ours, size, mode):
    image = noise_image(*size, seed=3, mode=mode)
    ids, items = _prompt(ours, [image])
    enc = _hf_inputs(hf, [image])
    assert ids == enc["input_ids"][0].tolist()  # placeholder text and its tokens
    want = enc["pixel_values"][0].numpy()
    got = np.frombuffer(items[0].pixel_values, dtype="<f4").reshape(items[0].shape)
    assert got.shape == want.shape and np.array_equal(got, want)


def _logits_run(ex, ids, images, cuts=()):
    """Writes the prompt in chunks ending at cuts (then the rest), each chunk with the images its span touches;
    returns the output after the prompt and the cache id."""
    cache_id, pos = None, 0
    for end in [*cuts, len(ids)]:
        touching = tuple(im for im in images if im.offset < end and im.offset + im.length > pos)
        (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[pos:end]), cache_id, pos, end == len(ids),
                                                        output=LOGITS, images=touching)]))
        cache_id, pos = res.cache.cache_id, end
    return res.output, cache_id


def test_logits_and_greedy_match_transformers(hf, ours, ex):
    images = [noise_image(50, 70, seed=1), noise_image(20, 24, seed=2)]
    ids, items = _prompt(ours, images)
    enc = _hf_inputs(hf, images)
    with torch.no_grad():
        out = hf[1].generate(**enc, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want_tokens = out.sequences[0, len(ids):].tolist()
    first, cache_id = _logits_run(ex, ids, items)
    assert rel_err(first.logits[0], out.logits[0][0]) <= 1e-4
    tokens = [first.tokens[0].token_id]
    for step in range(1, len(want_tokens)):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(ids) + step - 1), tokens[-1], output=LOGITS)])
        assert rel_err(d.output.logits[0], out.logits[step][0]) <= 1e-4
        tokens.append(d.output.tokens[0].token_id)
    assert tokens == want_tokens
    ex.release_cache([cache_id])


def test_chunk_boundaries_inside_an_image_change_nothing(ours, ex):
    ids, items = _prompt(ours, [noise_image(90, 40, seed=4)])
    whole, c1 = _logits_run(ex, ids, items)
    span = items[0]
    before = ex.vision_stats()
    chunked, c2 = _logits_run(ex, ids, items, cuts=(span.offset + 3, span.offset + 11, span.offset + span.length - 1))
    assert rel_err(chunked.logits[0], whole.logits[0]) <= 1e-5
    after = ex.vision_stats()
    assert after.images_encoded == before.images_encoded  # the same image: its embedding came from the cache
    # each chunk holding some of its image tokens (the first holds only its opening markers)
    assert after.embedding_cache_hits == before.embedding_cache_hits + 3
    ex.release_cache([c1, c2])


def test_prefix_cache_keys_blocks_by_image(ours, ex):
    text = "Tell me about the town by the sea and the boats."
    ids_a, im_a = _prompt(ours, [noise_image(50, 70, seed=5)], text)
    ids_b, im_b = _prompt(ours, [noise_image(50, 70, seed=6)], text)
    assert ids_a == ids_b and im_a[0].content_hash != im_b[0].content_hash
    out_a, cache_a = _logits_run(ex, ids_a, im_a)
    ex.release_cache([cache_a])  # its full blocks stay cached

    def reused(items):
        spans = tuple(ImageInput(i.content_hash, i.offset, i.length) for i in items)
        (res,) = raising(ex.create_caches([CreateCacheItem(tuple(ids_a), images=spans)]))
        ex.release_cache([res.cache.cache_id])
        return res.cached_tokens

    bs = ex.kv.block_size
    assert reused(im_a) == (len(ids_a) - 1) // bs * bs  # the same image: every full block
    assert reused(im_b) == im_b[0].offset // bs * bs  # another image: only the blocks before its span
    out_b, cache_b = _logits_run(ex, ids_b, im_b)
    assert rel_err(out_b.logits[0], out_a.logits[0]) > 1e-3  # and the image changes the answer
    ex.release_cache([cache_b])


def test_bad_images_fail_their_item(ours, ex):
    ids, items = _prompt(ours, [noise_image(20, 24, seed=7)])
    im = items[0]
    from dataclasses import replace
    bad = {
        "shape": replace(im, shape=(1, 3, 16, 16)),
        "bytes": replace(im, pixel_values=im.pixel_values[:-4]),
        "hash": replace(im, content_hash="0" * 32),
        "count": replace(im, length=im.length - 2),
    }
    for why, image in bad.items():
        (res,) = ex.unified_decode([UnifiedItem(tuple(ids), images=(image,))])
        assert res.error is not None, why
        assert "image 0" in str(res.error), (why, str(res.error))


def test_smolvlm_logits_match_transformers(tmp_path_factory):
    """SmolVLM is Idefics3's architecture under another name (same tower, connector, processor and placeholder
    text): its checkpoint loads and matches transformers' SmolVLMForConditionalGeneration."""
    import transformers
    ckpt = vision_checkpoint(tmp_path_factory, "SmolVLM")
    ours = (ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt))
    ids, items = _prompt(ours, [noise_image(70, 50, seed=9)])
    pixels = torch.from_numpy(np.frombuffer(items[0].pixel_values, dtype="<f4").reshape(items[0].shape).copy())
    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(ckpt).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=pixels[None]).logits[0, -1]
    first, cache_id = _logits_run(make_executor(ckpt), ids, items)
    assert rel_err(first.logits[0], want) <= 1e-4 and first.tokens[0].token_id == int(want.argmax())


def test_image_and_text_items_in_one_forward(ours, ex):
    """A mixed call (an image prompt, a text prompt, another image prompt) gives each item what it gets alone."""
    a_ids, a_im = _prompt(ours, [noise_image(50, 70, seed=31)])
    b_ids, b_im = _prompt(ours, [noise_image(20, 24, seed=32)], "Another one.")
    text = [5, 6, 7, 8, 9, 10, 11]
    alone = [_logits_run(ex, a_ids, a_im), _logits_run(ex, text, ()), _logits_run(ex, b_ids, b_im)]
    together = raising(ex.unified_decode([UnifiedItem(tuple(a_ids), output=LOGITS, images=a_im),
                                          UnifiedItem(tuple(text), output=LOGITS),
                                          UnifiedItem(tuple(b_ids), output=LOGITS, images=b_im)]))
    for (out, cache_id), res in zip(alone, together):
        assert rel_err(res.output.logits[0], out.logits[0]) <= 1e-5
        ex.release_cache([cache_id, res.cache.cache_id])


def test_a_marker_in_the_text_is_refused(ours):
    from tandem.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="image markers"):
        _prompt(ours, [noise_image(20, 24)], text="and here <image> too")
