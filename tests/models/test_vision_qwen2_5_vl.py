"""Qwen2.5-VL in process: the scheduler's numpy/Pillow image processor and placeholder text against transformers'
own (PIL image processor, Qwen2_5_VLProcessor's expansion), and the executor's vision tower + Qwen2 text tower with
M-RoPE against transformers' Qwen2_5_VLForConditionalGeneration on the same images and text: logits and greedy
tokens (the decode steps' positions carry the images' rope delta), chunk boundaries inside an image's tokens, the
prefix cache keyed by image (and a cache made from it continuing at the right positions), mixed batches, bad
images, and the decode steps that cannot take M-RoPE refused with the reason."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from executor_service.types import (CacheRef, CreateCacheItem, DecodeItem, ImageInput, OutputMode, OutputOptions,
                                    UnifiedItem)
from scheduler.text.tokenizer import ModelTokenizer
from scheduler.vision.chat_images import ChatImages
from scheduler.vision.media_policy import MediaPolicy
from tests.executor_driver import make_executor, raising
from tests.hf_reference import rel_err
from tests.vision_harness import chat_prompt
from tests.qwen_vl_checkpoint import MERGE, image_processor_class, qwen_vl_checkpoint
from tests.vision_checkpoints import noise_image

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)
# 48x72 (6x9 merged: windows padded), 24x24 (3x3), a downscale past max_pixels, an upscale to min_pixels
SIZES = [(50, 70), (20, 24), (200, 90), (5, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen_vl_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval()
    return tok, image_processor_class().from_pretrained(ckpt), model


@pytest.fixture(scope="module")
def ours(ckpt):
    return ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt)


@pytest.fixture(scope="module")
def ex(ckpt):
    return make_executor(ckpt)


def _prompt(ours, images, text="Describe the fish."):
    return chat_prompt(ours, images, text)


def _hf_inputs(hf, images, text="Describe the fish."):
    """transformers' image processor, its processor's placeholder expansion and mm_token_type_ids."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    tok, proc, model = hf
    enc = proc(images=list(images), return_tensors="pt")
    expand = SimpleNamespace(image_processor=proc, image_token="<|image_pad|>")
    pads = [Qwen2_5_VLProcessor.replace_image_token(expand, enc, i) for i in range(len(images))]
    prompt = ("<|im_start|>user\n" + "".join(f"<|vision_start|>{p}<|vision_end|>" for p in pads) + text
              + "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt)["input_ids"]
    types = [int(t == model.config.image_token_id) for t in ids]
    return dict(input_ids=torch.tensor([ids]), pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                mm_token_type_ids=torch.tensor([types]))


@pytest.mark.parametrize("size,mode", [(s, "RGB") for s in SIZES] + [((50, 70), "RGBA"), ((30, 33), "L")])
def test_processor_matches_transformers(hf, ours, size, mode):
    image = noise_image(*size, seed=3, mode=mode)
    ids, items = _prompt(ours, [image])
    enc = _hf_inputs(hf, [image])
    assert ids == enc["input_ids"][0].tolist()  # placeholder text and its tokens
    _, rows, cols = enc["image_grid_thw"][0].tolist()
    assert items[0].shape[:2] == (rows // MERGE, cols // MERGE)
    got = np.frombuffer(items[0].pixel_values, dtype="<f4").reshape(-1, items[0].shape[-1])
    assert np.array_equal(got, enc["pixel_values"].numpy())


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


def _greedy(ex, first, cache_id, start, steps):
    """The first token, then decode steps from position start: (tokens, logits of each step)."""
    tokens, logits = [first.tokens[0].token_id], [first.logits[0]]
    for step in range(1, steps):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, start + step - 1), tokens[-1], output=LOGITS)])
        tokens.append(d.output.tokens[0].token_id)
        logits.append(d.output.logits[0])
    return tokens, logits


def test_logits_and_greedy_match_transformers(hf, ours, ex):
    images = [noise_image(50, 70, seed=1), noise_image(20, 24, seed=2)]  # two grids: the deltas add up
    ids, items = _prompt(ours, images)
    enc = _hf_inputs(hf, images)
    assert ids == enc["input_ids"][0].tolist()
    with torch.no_grad():
        out = hf[2].generate(**enc, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want_tokens = out.sequences[0, len(ids):].tolist()
    first, cache_id = _logits_run(ex, ids, items)
    tokens, logits = _greedy(ex, first, cache_id, len(ids), len(want_tokens))
    assert tokens == want_tokens
    for ours_row, want in zip(logits, out.logits):
        assert rel_err(ours_row, want[0]) <= 1e-4
    ex.release_cache([cache_id])


def test_chunk_boundaries_inside_an_image_change_nothing(ours, ex):
    ids, items = _prompt(ours, [noise_image(90, 40, seed=4)])
    whole, c1 = _logits_run(ex, ids, items)
    span = items[0]
    before = ex.vision_stats()
    cuts = (span.offset - 1, span.offset + 3, span.offset + 11, span.offset + span.length - 1)
    chunked, c2 = _logits_run(ex, ids, items, cuts=cuts)
    assert rel_err(chunked.logits[0], whole.logits[0]) <= 1e-5
    a, _ = _greedy(ex, whole, c1, len(ids), 4)
    b, _ = _greedy(ex, chunked, c2, len(ids), 4)
    assert a == b
    after = ex.vision_stats()
    assert after.images_encoded == before.images_encoded  # the same image: its embedding came from the cache
    ex.release_cache([c1, c2])


def test_prefix_cache_keys_blocks_by_image(ours, ex):
    text = "Tell me about the town by the sea and the boats, the fish and the nets and the old harbour wall."
    ids_a, im_a = _prompt(ours, [noise_image(50, 70, seed=5)], text)
    ids_b, im_b = _prompt(ours, [noise_image(50, 70, seed=6)], text)
    assert ids_a == ids_b and im_a[0].content_hash != im_b[0].content_hash
    out_a, cache_a = _logits_run(ex, ids_a, im_a)
    want, _ = _greedy(ex, out_a, cache_a, len(ids_a), 4)
    ex.release_cache([cache_a])  # its full blocks stay cached

    def reused(items):
        spans = tuple(ImageInput(i.content_hash, i.offset, i.length, shape=i.shape) for i in items)
        (res,) = raising(ex.create_caches([CreateCacheItem(tuple(ids_a), images=spans)]))
        return res.cache.cache_id, res.cached_tokens

    bs = ex.kv.block_size
    cache, hit = reused(im_a)
    assert len(ids_a) > hit > im_a[0].offset + im_a[0].length  # past the image: its shift must be known
    (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids_a[hit:]), cache, hit, True, output=LOGITS)]))
    assert rel_err(res.output.logits[0], out_a.logits[0]) <= 1e-5
    assert _greedy(ex, res.output, cache, len(ids_a), 4)[0] == want
    ex.release_cache([cache])
    cache, hit = reused(im_b)
    assert hit == im_b[0].offset // bs * bs  # another image: only the blocks before its span
    ex.release_cache([cache])
    out_b, cache_b = _logits_run(ex, ids_b, im_b)
    assert rel_err(out_b.logits[0], out_a.logits[0]) > 1e-3  # and the image changes the answer
    ex.release_cache([cache_b])


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


def test_bad_images_fail_their_item(ours, ex):
    ids, items = _prompt(ours, [noise_image(20, 24, seed=7)])
    im = items[0]
    broken = list(ids)
    broken[im.offset + 1] = broken[im.offset - 1]  # a text token inside the run of image tokens
    bad = {
        "shape": (ids, replace(im, shape=(1, 9, 2, 2, 96))),
        "bytes": (ids, replace(im, pixel_values=im.pixel_values[:-4])),
        "count": (ids, replace(im, length=im.length - 2)),
        "run": (broken, replace(im, length=im.length + 1)),
    }
    for why, (tokens, image) in bad.items():
        (res,) = ex.unified_decode([UnifiedItem(tuple(tokens), images=(image,))])
        assert res.error is not None, why
        assert "image 0" in str(res.error), (why, str(res.error))


@pytest.mark.parametrize("flags,named", [({"decode_kernel": "native"}, "M-RoPE"), ({"compile": True}, "M-RoPE")])
def test_decode_steps_without_mrope_are_refused(ckpt, flags, named):
    with pytest.raises(ValueError, match=named):
        make_executor(ckpt, **flags)


def test_drafts_after_an_image_verify_at_its_shifted_positions(ours, ex):
    """Draft tokens (speculative decoding) run in the eager forward at M-RoPE positions: the greedy continuation
    sent as drafts is accepted whole and the token after it is the one greedy decoding gives."""
    ids, items = _prompt(ours, [noise_image(50, 70, seed=8)])
    first, c1 = _logits_run(ex, ids, items)
    want, _ = _greedy(ex, first, c1, len(ids), 5)
    second, c2 = _logits_run(ex, ids, items)
    (d,) = raising(ex.unified_decode([UnifiedItem((want[0],), c2, len(ids), True,
                                                  draft_token_ids=tuple(want[1:4]))]))
    assert [t.token_id for t in d.output.tokens] == want[1:5]
    ex.release_cache([c1, c2])


def test_a_cache_with_images_moves_with_its_grids(ours, ex):
    """A transfer carries the cache's image spans and M-RoPE grids (executor_service/kv/transfer/image_spans.py):
    a cache exported and imported (here into the same executor) decodes the tokens of the cache it came from, and
    one cut inside an image's tokens finishes its prompt there at the right positions. An importer that does not
    say it builds the spans (an older executor) is refused naming the field."""
    from tandem.errors import Unsupported
    ids, items = _prompt(ours, [noise_image(50, 70, seed=9)])
    first, cache_id = _logits_run(ex, ids, items)
    want, want_logits = _greedy(ex, first, cache_id, len(ids), 5)
    ex.release_cache([cache_id])
    second, cache_id = _logits_run(ex, ids, items)
    with pytest.raises(Unsupported, match="accept_images"):
        next(ex.transfer.export(cache_id, (), ""))
    moved = ex.transfer.import_(ex.transfer.export(cache_id, (), "", accept_images=True), True, "")
    assert moved.num_tokens == len(ids)
    tokens, logits = _greedy(ex, second, moved.cache_id, len(ids), 5)
    assert tokens == want and all(rel_err(a, b) <= 1e-5 for a, b in zip(logits, want_logits))
    cut = items[0].offset + 7  # a cache written part of the way through the image: the rest of the prompt there
    (part,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[:cut]), None, 0, False, images=items)]))
    half = ex.transfer.import_(ex.transfer.export(part.cache.cache_id, (), "", accept_images=True), True, "")
    (rest,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[cut:]), half.cache_id, cut, True, output=LOGITS,
                                                     images=items)]))
    assert rel_err(rest.output.logits[0], first.logits[0]) <= 1e-5
    tokens, logits = _greedy(ex, rest.output, half.cache_id, len(ids), 5)
    assert tokens == want and all(rel_err(a, b) <= 1e-5 for a, b in zip(logits, want_logits))
    ex.release_cache([cache_id, moved.cache_id, part.cache.cache_id, half.cache_id])


def test_the_hubs_flat_config_loads_the_same_model(ckpt, ours, ex, tmp_path):
    """The Hub's Qwen2.5-VL config.json keeps the text fields at the top level with rope_scaling
    {"type": "mrope", "mrope_section": ...}; it reads as the same model as transformers 5's text_config."""
    import json
    import shutil
    flat_dir = tmp_path / "flat"
    shutil.copytree(ckpt, flat_dir)
    raw = json.loads((ckpt / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": "mrope", **{k: v for k, v in rope.items()
                                                                                      if k != "rope_type"}})
    (flat_dir / "config.json").write_text(json.dumps({**raw, **text}))
    ids, items = _prompt(ours, [noise_image(50, 70, seed=10)])
    want, c1 = _logits_run(ex, ids, items)
    got, _ = _logits_run(make_executor(flat_dir), ids, items)
    assert torch.equal(got.logits[0], want.logits[0])
    ex.release_cache([c1])


def test_a_recompute_of_prompt_and_output_continues_the_same(ours, ex):
    """Preemption's recompute: a new cache written with the prompt and the tokens generated so far (in chunks,
    the image carried again) gives the logits the decode steps gave: the output tokens sit at shifted positions."""
    ids, items = _prompt(ours, [noise_image(50, 70, seed=12)])
    first, c1 = _logits_run(ex, ids, items)
    tokens, logits = _greedy(ex, first, c1, len(ids), 5)
    again, c2 = _logits_run(ex, ids + tokens[:4], items, cuts=(items[0].offset + 5, len(ids) + 2))
    assert rel_err(again.logits[0], logits[4]) <= 1e-5
    ex.release_cache([c1, c2])


def test_an_image_too_thin_is_refused_naming_the_part(ours):
    """smart_resize's bound (a side over 200 times the other), as transformers refuses it, is a 400 naming the part."""
    from tandem.errors import InvalidRequest
    from tests.vision_checkpoints import png_bytes
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[1\]\.image_url: .*aspect ratio"):
        ours[0].load_image("messages[0].content[1].image_url", data=png_bytes(noise_image(402, 2)))
