"""Gemma 3 with images (Gemma3ForConditionalGeneration) in process: the scheduler's numpy/Pillow image processor
and placeholder text against transformers' own (PIL) processor, and the executor's SigLIP tower + projector +
Gemma 3 text tower against transformers on the same image and text — logits and greedy tokens with the image's
tokens attending to each other both ways (transformers' token_type_ids mask, on a sliding and a global layer),
chunk boundaries before and after the span, a chunk ending inside it refused, a reused prefix ending inside it,
prefix-cache keys by image, and the attention backends that cannot apply it refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_service.types import CacheRef, CreateCacheItem, DecodeItem, ImageInput, OutputMode, OutputOptions, UnifiedItem
from models.attention.backend import choose_backend
from scheduler.text.tokenizer import ChatMessage, ModelTokenizer
from scheduler.vision.chat_images import ChatImages
from scheduler.vision.gemma3_processor import Gemma3ImageProcessor
from scheduler.vision.media_policy import MediaPolicy
from tandem.errors import CheckpointError
from tests.executor_driver import make_executor, raising
from tests.hf_reference import rel_err
from tests.vision_checkpoints import GEMMA3_MM_TOKENS, gemma3_checkpoint, noise_image

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)
TEXT = "Describe the fish."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return gemma3_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(ckpt),
                           tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt), image_seq_length=GEMMA3_MM_TOKENS)
    return proc, transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def ours(ckpt):
    return ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt)


@pytest.fixture(scope="module")
def ex(ckpt):
    return make_executor(ckpt)


def _prompt(ours, images, text=TEXT):
    chat, tok = ours
    parts = tuple({"type": "image"} for _ in images) + ({"type": "text", "text": text},)
    ids, placed = chat.encode_chat(tok, [ChatMessage("user", parts)], [chat.processor.process(i) for i in images])
    assert all(p.one_chunk for p in placed)
    return ids, tuple(ImageInput(p.content_hash, p.offset, p.length, "float32", p.shape, p.pixels) for p in placed)


def _hf_inputs(hf, images, text=TEXT):
    prompt = "<|im_start|>user\n" + "<start_of_image>" * len(images) + text + "<|im_end|>\n<|im_start|>assistant\n"
    return hf[0](images=[list(images)], text=prompt, return_tensors="pt")


def _run(ex, ids, images, cuts=(), cache_id=None, pos=0):
    """Writes ids[pos:] in chunks ending at cuts (then the rest), each with the images its span touches."""
    for end in [*cuts, len(ids)]:
        touching = tuple(im for im in images if im.offset < end and im.offset + im.length > pos)
        (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[pos:end]), cache_id, pos, end == len(ids),
                                                        output=LOGITS, images=touching)]))
        cache_id, pos = res.cache.cache_id, end
    return res.output, cache_id


@pytest.mark.parametrize("size,mode", [((50, 70), "RGB"), ((20, 24), "RGB"), ((90, 40), "RGBA"), ((33, 30), "L")])
def test_processor_matches_transformers(hf, ours, size, mode):
    image = noise_image(*size, seed=3, mode=mode)
    ids, items = _prompt(ours, [image])
    enc = _hf_inputs(hf, [image])
    assert ids == enc["input_ids"][0].tolist()  # "\n\n<start_of_image>" + 4 image tokens + "<end_of_image>\n\n"
    block = [i for i, t in enumerate(enc["token_type_ids"][0].tolist()) if t]  # transformers' bidirectional block
    assert (items[0].offset, items[0].length) == (block[0], len(block)) and len(block) == GEMMA3_MM_TOKENS
    got = np.frombuffer(items[0].pixel_values, dtype="<f4").reshape(items[0].shape)
    assert np.array_equal(got, enc["pixel_values"].numpy())


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "size": {"height": 32, "width": 32}}


@pytest.fixture(scope="module")
def pas(ckpt, hf):
    """Pan-and-scan on (crops of at least 8 px, for these small images): ours and transformers'."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(**PAN_AND_SCAN),
                           tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt), image_seq_length=GEMMA3_MM_TOKENS)
    return (ChatImages(Gemma3ImageProcessor(PAN_AND_SCAN, GEMMA3_MM_TOKENS, "preprocessor"), MediaPolicy()),
            ModelTokenizer(ckpt)), (proc, hf[1])


def _pas_inputs(hf, images, text=TEXT):
    prompt = "<|im_start|>user\n" + "<start_of_image>" * len(images) + text + "<|im_end|>\n<|im_start|>assistant\n"
    return hf[0](images=[list(images)], text=prompt, return_tensors="pt", do_pan_and_scan=True,
                 pan_and_scan_min_crop_size=PAN_AND_SCAN["pan_and_scan_min_crop_size"])


@pytest.mark.parametrize("size,views", [((90, 40), 3), ((40, 90), 3), ((200, 20), 5), ((50, 45), 1)])
def test_pan_and_scan_matches_transformers(pas, size, views):
    """Each view (the whole image, then each crop) is an image of its own, its span its image tokens."""
    ours, theirs = pas
    image = noise_image(*size, seed=2)
    ids, items = _prompt(ours, [image])
    enc = _pas_inputs(theirs, [image])
    assert ids == enc["input_ids"][0].tolist() and len(items) == views
    flags = enc["token_type_ids"][0].tolist()
    starts = [i for i, t in enumerate(flags) if t and not flags[i - 1]]
    assert [(im.offset, im.length) for im in items] == [(i, GEMMA3_MM_TOKENS) for i in starts]
    got = np.concatenate([np.frombuffer(im.pixel_values, dtype="<f4").reshape(im.shape) for im in items])
    assert np.array_equal(got, enc["pixel_values"].numpy())


def test_pan_and_scan_logits_match_transformers(pas, ex):
    ours, theirs = pas
    image = noise_image(90, 40, seed=9)
    ids, items = _prompt(ours, [image])
    enc = _pas_inputs(theirs, [image])
    with torch.no_grad():
        want = theirs[1](**enc).logits[0, -1]
    out, cache_id = _run(ex, ids, items, cuts=(items[1].offset,))  # (a chunk boundary between two views)
    assert rel_err(out.logits[0], want) <= 1e-4 and out.tokens[0].token_id == int(want.argmax())
    ex.release_cache([cache_id])


def test_nulls_are_transformers_defaults():
    # gemma-3-4b-it's preprocessor_config.json writes null for what it leaves at transformers' defaults
    released = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
                "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
                "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
                "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
                "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
                "size": {"height": 896, "width": 896}}
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    image = noise_image(300, 200, seed=8)
    out = Gemma3ImageProcessor(released, 256, "preprocessor").process(image)
    want = Gemma3ImageProcessorPil.from_dict(released)(images=[image], return_tensors="np")["pixel_values"]
    assert out.pixels.shape == (1, 3, 896, 896) and np.array_equal(out.pixels, want)


def test_logits_and_greedy_match_transformers(hf, ours, ex):
    images = [noise_image(50, 70, seed=1), noise_image(20, 24, seed=2)]
    ids, items = _prompt(ours, images)
    enc = _hf_inputs(hf, images)
    assert ids == enc["input_ids"][0].tolist()
    with torch.no_grad():
        out = hf[1].generate(**enc, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        causal = hf[1](input_ids=enc["input_ids"], pixel_values=enc["pixel_values"]).logits[0, -1]  # no block mask
    want_tokens = out.sequences[0, len(ids):].tolist()
    first, cache_id = _run(ex, ids, items)
    assert rel_err(first.logits[0], out.logits[0][0]) <= 1e-4
    assert rel_err(first.logits[0], causal) > 1e-3  # (the both-ways attention is what makes them equal)
    tokens = [first.tokens[0].token_id]
    for step in range(1, len(want_tokens)):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(ids) + step - 1), tokens[-1], output=LOGITS)])
        assert rel_err(d.output.logits[0], out.logits[step][0]) <= 1e-4
        tokens.append(d.output.tokens[0].token_id)
    assert tokens == want_tokens
    ex.release_cache([cache_id])


def test_chunks_around_the_span_change_nothing_and_inside_it_are_refused(ours, ex):
    ids, items = _prompt(ours, [noise_image(90, 40, seed=4)])
    lo, hi = items[0].offset, items[0].offset + items[0].length
    whole, c1 = _run(ex, ids, items)
    for cuts in ((lo,), (hi,), (3, lo, hi, hi + 2)):
        chunked, c2 = _run(ex, ids, items, cuts)
        assert rel_err(chunked.logits[0], whole.logits[0]) <= 1e-5, cuts
        ex.release_cache([c2])
    (res,) = ex.unified_decode([UnifiedItem(tuple(ids[:lo + 2]), images=items)])  # a first chunk ending inside
    ex.release_cache([c1])
    assert res.error is not None and "inside its span" in str(res.error) and "image 0" in str(res.error)


def test_image_and_text_items_in_one_forward(ours, ex):
    """A mixed call (an image prompt, a text prompt, another image prompt at another length) gives each item what
    it gets alone: each item's overlay is its own."""
    a_ids, a_im = _prompt(ours, [noise_image(50, 70, seed=31)])
    b_ids, b_im = _prompt(ours, [noise_image(20, 24, seed=32)], "Another one, please.")
    text = [5, 6, 7, 8, 9, 10, 11]
    alone = [_run(ex, a_ids, a_im), _run(ex, text, ()), _run(ex, b_ids, b_im)]
    together = raising(ex.unified_decode([UnifiedItem(tuple(a_ids), output=LOGITS, images=a_im),
                                          UnifiedItem(tuple(text), output=LOGITS),
                                          UnifiedItem(tuple(b_ids), output=LOGITS, images=b_im)]))
    for (out, cache_id), res in zip(alone, together):
        assert rel_err(res.output.logits[0], out.logits[0]) <= 1e-5
        ex.release_cache([cache_id, res.cache.cache_id])


def test_a_span_must_be_its_image_tokens(ours, ex):
    ids, items = _prompt(ours, [noise_image(20, 24, seed=7)])
    from dataclasses import replace
    wider = replace(items[0], offset=items[0].offset - 1, length=items[0].length + 2)  # with <start/end_of_image>
    (res,) = ex.unified_decode([UnifiedItem(tuple(ids), images=(wider,))])
    assert res.error is not None and "exactly its 4 image tokens" in str(res.error)


def _straddling(ex, ours, seed: int) -> tuple[list[int], tuple[ImageInput, ...]]:
    """Token ids whose image span [bs - 2, bs + 2) straddles the first block boundary, with the image."""
    bs = ex.kv.block_size
    ids, (im,) = _prompt(ours, [noise_image(50, 70, seed=seed)])
    boi, image, eoi = ids[im.offset - 1], ids[im.offset], ids[im.offset + im.length]
    ids = [ids[0]] + [100 + i for i in range(bs - 4)] + [boi] + [image] * im.length + [eoi] + [120, 121, 122, 123]
    return ids, (ImageInput(im.content_hash, bs - 2, im.length, "float32", im.shape, im.pixel_values),)


def test_prefix_cache_keys_by_image_and_a_reused_prefix_may_end_inside_the_span(ours, ex):
    ids, im_a = _straddling(ex, ours, 5)
    _, im_b = _straddling(ex, ours, 6)
    bs = ex.kv.block_size
    whole, cache_a = _run(ex, ids, im_a)
    ex.release_cache([cache_a])  # its first block (half the image's tokens) stays cached

    def reused(images):
        spans = tuple(ImageInput(i.content_hash, i.offset, i.length) for i in images)
        (res,) = raising(ex.create_caches([CreateCacheItem(tuple(ids), images=spans)]))
        return res.cache.cache_id, res.cached_tokens

    cache_b, got = reused(im_b)
    ex.release_cache([cache_b])
    assert got == 0  # another image: the block holding its first tokens is keyed by it
    cache_a, got = reused(im_a)
    assert got == bs  # the same image: the block, image tokens and all, ending inside the span
    # the rest of the prompt from inside the span: its tokens see the whole span, the cached ones included
    again, cache_a = _run(ex, ids, im_a, cache_id=cache_a, pos=bs)
    assert rel_err(again.logits[0], whole.logits[0]) <= 1e-5
    other, cache_b = _run(ex, ids, im_b)
    assert rel_err(other.logits[0], whole.logits[0]) > 1e-3  # and the image changes the answer
    ex.release_cache([cache_a, cache_b])


def test_only_the_gathered_backend_runs_both_ways_attention(ckpt):
    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, bidirectional_images=True) == "gathered"
    assert choose_backend("auto", torch.device("cuda"), bidirectional_images=True) == "gathered"
    for name in ("flex", "flashinfer"):
        with pytest.raises(ValueError, match="both ways"):
            choose_backend(name, cpu, bidirectional_images=True)
    with pytest.raises(ValueError, match="both ways"):
        make_executor(ckpt, attention_backend="flex")


def test_a_released_config_json_parses():
    """gemma-3-4b-it's config.json as published (most text fields left to Gemma3TextConfig's defaults, dtype and
    eos at the top): its shapes, windows, ropes and the projector's pooling."""
    from models.families import FAMILIES
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "image_token_index": 262144,
           "mm_tokens_per_image": 256, "model_type": "gemma3", "torch_dtype": "bfloat16",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    f = FAMILIES["Gemma3ForConditionalGeneration"](raw, "Gemma3ForConditionalGeneration", "config.json")
    assert (f["num_layers"], f["num_heads"], f["head_dim"], f["vocab_size"]) == (34, 8, 256, 262208)
    assert (f["torch_dtype"], f["eos_token_ids"], f["sliding_window"]) == ("bfloat16", (1, 106), 1024)
    assert f["layer_types"][:6] == ("sliding_attention",) * 5 + ("full_attention",) and f["final_softcap"] is None
    assert f["rope"].kind == "linear" and f["local_rope"].theta == 10000.0
    v = f["vision"]
    assert (v.scale_factor, v.tokens_per_tile, v.image_token_id, v.bidirectional_images) == (4, 256, 262144, True)
    with pytest.raises(CheckpointError, match="mm_tokens_per_image"):
        FAMILIES["Gemma3ForConditionalGeneration"]({**raw, "mm_tokens_per_image": 200}, "x", "config.json")


def test_the_released_tensor_names_load_too(ckpt, tmp_path):
    """Released checkpoints nest the encoder as vision_tower.vision_model.*; transformers 5 saves vision_tower.*."""
    import shutil

    from safetensors.torch import load_file, save_file

    from models.loader import load_model
    released = shutil.copytree(ckpt, tmp_path / "released")
    state = load_file(str(released / "model.safetensors"))
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in state.items()}
    assert renamed != state
    save_file(renamed, str(released / "model.safetensors"), metadata={"format": "pt"})
    pixels = torch.randn(2, 3, 32, 32)
    assert torch.equal(load_model(released, "cpu", "float32").vision(pixels),
                       load_model(ckpt, "cpu", "float32").vision(pixels))


def test_a_cache_moved_after_its_image_finishes_its_prompt_the_same(ours, ex):
    """KV transfer (executor_service/kv/transfer/image_spans.py): a cache written through an image's span, exported
    and imported (into the same executor), finishes its prompt with the logits of the cache that never moved —
    the image's both-ways span was written before the move, and its hash keys the imported cache's later blocks."""
    ids, items = _prompt(ours, [noise_image(90, 40, seed=7)])
    hi = items[0].offset + items[0].length
    whole, c1 = _run(ex, ids, items)
    _, part = _run(ex, ids[:hi], items)
    moved = ex.transfer.import_(ex.transfer.export(part, (), "", accept_images=True), True, "")
    assert ex.cache_table("").get(moved.cache_id).images == [(items[0].offset, items[0].length, items[0].content_hash)]
    rest, c2 = _run(ex, ids, (), cache_id=moved.cache_id, pos=hi)
    assert rel_err(rest.logits[0], whole.logits[0]) <= 1e-5
    ex.release_cache([c1, part, c2])
