"""LoRA on the language model of a vision-language model, with images (Idefics3/SmolVLM, Qwen2.5-VL, Gemma 3): a peft
adapter made on the tiny checkpoint with target_modules restricted to the text tower by regex (as users write it:
the vision tower has q_proj too), served beside the base model in the same calls — the adapted request equals
transformers + peft, the base one transformers alone, on the same image and text, and chunk boundaries inside the
image change nothing; peft's rank/alpha patterns and older exports' module names read right; an image's embedding
is shared across adapters (the encoder is not adapted) but its KV blocks are not (the prefix cache keys blocks by
adapter); and an adapter on the vision encoder is refused at load, naming the module."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_service.types import (CacheRef, CreateCacheItem, DecodeItem, ImageInput, OutputMode, OutputOptions,
                                    UnifiedItem)
from scheduler.text.tokenizer import ModelTokenizer
from scheduler.vision.chat_images import ChatImages
from scheduler.vision.media_policy import MediaPolicy
from models.lora.weights import read_adapter
from tandem.errors import InvalidRequest
from tests.executor_driver import make_executor, raising
from tests.hf_reference import rel_err
from tests.lora_fixtures import edit_adapter_config, edit_adapter_tensors, make_peft_adapter
from tests.qwen_vl_checkpoint import qwen_vl_checkpoint
from tests.vision_checkpoints import gemma3_checkpoint, noise_image, vision_checkpoint
from tests.vision_harness import chat_prompt

LOGITS = OutputOptions(OutputMode.TOKENS_AND_LOGITS)
STEPS = 6
# The text tower's attention and MLP projections, by regex over transformers' module names (Idefics3's
# `model.text_model.layers.N...`, Qwen2.5-VL's and Gemma 3's `model.language_model.layers.N...`)
TEXT_TOWER = r".*\.(language_model|text_model)\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
TEXT_QV = r".*\.(language_model|text_model)\.layers\.\d+\.self_attn\.[qv]_proj"
# peft's patterns match the end of the module's full name (the executor reads them against the same names)
RANK_PATTERN = {r"(language_model|text_model)\.layers\.1\.self_attn\.q_proj": 4}
ALPHA_PATTERN = {r"(language_model|text_model)\.layers\.0\.mlp\.down_proj": 64}
# How older exports name the text tower (Qwen2.5-VL before transformers 4.52: `model.layers`; Gemma 3:
# `language_model.model.layers`; an Idefics3 adapter trained on its text tower alone, as a causal LM: `model.layers`)
LEGACY = {"idefics3": "model.layers.", "qwen2_5_vl": "model.layers.", "gemma3": "language_model.model.layers."}
# (family: the checkpoint, transformers' class, target_modules that reach into its vision encoder, the module named)
FAMILIES = {
    "idefics3": (vision_checkpoint, "Idefics3ForConditionalGeneration", ["q_proj", "v_proj"],
                 "model.vision_model.encoder.layers.0.self_attn.q_proj"),
    "qwen2_5_vl": (qwen_vl_checkpoint, "Qwen2_5_VLForConditionalGeneration", r".*\.mlp\.(gate|up)_proj",
                   "model.visual.blocks.0.mlp.gate_proj"),
    "gemma3": (gemma3_checkpoint, "Gemma3ForConditionalGeneration", ["q_proj", "v_proj"],
               "model.vision_tower.encoder.layers.0.self_attn.q_proj"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """The family's checkpoint, two text-tower adapters (a: every projection, with rank and alpha patterns; b: q/v)
    loaded in one executor."""
    import transformers
    family = request.param
    make_ckpt, cls_name, _, _ = FAMILIES[family]
    ckpt = make_ckpt(tmp_path_factory)
    cls = getattr(transformers, cls_name)
    root = tmp_path_factory.mktemp(f"adapters-{family}")
    make_peft_adapter(ckpt, root / "a", r=8, alpha=16, target_modules=TEXT_TOWER, seed=1, model_class=cls,
                      rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN)
    make_peft_adapter(ckpt, root / "b", r=4, alpha=8, target_modules=TEXT_QV, seed=2, model_class=cls)
    ex = make_executor(ckpt, adapter_root=root, adapters=(("a", root / "a"), ("b", root / "b")))
    ours = (ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt))
    return family, ckpt, cls, root, ex, ours


def _hf_inputs(family: str, config, ids: list[int], image: ImageInput) -> dict[str, torch.Tensor]:
    """transformers' model inputs for one image's prompt, from the very pixels the executor got (the processor's
    parity with transformers' is tests/models/test_vision_*.py's)."""
    pixels = torch.from_numpy(np.frombuffer(image.pixel_values, dtype="<f4").reshape(image.shape).copy())
    input_ids = torch.tensor([ids])
    is_image = (input_ids == config.image_token_id).long()  # [1, tokens]
    if family == "idefics3":
        return dict(input_ids=input_ids, pixel_values=pixels[None])  # [1, tiles, 3, H, W]
    if family == "qwen2_5_vl":
        rows, cols, merge = image.shape[0], image.shape[1], image.shape[2]  # merged grid, merge factor
        return dict(input_ids=input_ids, pixel_values=pixels.reshape(-1, image.shape[-1]),  # [patches, dim]
                    image_grid_thw=torch.tensor([[1, rows * merge, cols * merge]]), mm_token_type_ids=is_image)
    return dict(input_ids=input_ids, pixel_values=pixels, token_type_ids=is_image)  # gemma3: [1, 3, H, W]


def _reference(cls, ckpt, adapter_dir, inputs) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and logits, with the adapter applied by peft (None: the base model)."""
    model = cls.from_pretrained(ckpt).eval()
    if adapter_dir is not None:
        from peft import PeftModel
        PeftModel.from_pretrained(model, adapter_dir)  # wraps the layers of `model` in place
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [row[0].float() for row in out.logits]


def test_adapted_and_base_requests_in_one_batch_match_transformers(served):
    """The same image prompt under the adapter and under the base model, in the same calls (prefill, then decode
    steps): each equals its own reference, so adapters stay per request around images."""
    family, ckpt, cls, root, ex, ours = served
    ids, (image,) = chat_prompt(ours, [noise_image(50, 70, seed=11)])
    adapters = ("a", "")
    results = raising(ex.unified_decode([UnifiedItem(tuple(ids), output=LOGITS, adapter=a, images=(image,))
                                         for a in adapters]))
    caches = [r.cache.cache_id for r in results]
    tokens = [[r.output.tokens[0].token_id] for r in results]
    logits = [[r.output.logits[0]] for r in results]
    for step in range(1, STEPS):
        out = ex.decode([DecodeItem(CacheRef(c, len(ids) + step - 1), t[-1], output=LOGITS, adapter=a)
                         for c, t, a in zip(caches, tokens, adapters)])
        for i, d in enumerate(raising(out)):
            tokens[i].append(d.output.tokens[0].token_id)
            logits[i].append(d.output.logits[0])
    ex.release_cache(caches)
    inputs = _hf_inputs(family, ex.model_config.vision, ids, image)
    for i, adapter_dir in enumerate((root / "a", None)):
        want_tokens, want_logits = _reference(cls, ckpt, adapter_dir, inputs)
        assert tokens[i] == want_tokens, (family, adapters[i])
        assert max(rel_err(o, w) for o, w in zip(logits[i], want_logits)) <= 1e-4, (family, adapters[i])
    assert rel_err(logits[0][0], logits[1][0]) > 1e-3  # the adapter moves the logits


def _written(ex, ids, image, cuts, adapter):
    """The prompt written in chunks ending at cuts (then the rest), each with the image if its span touches it:
    the output after the prompt (the cache released)."""
    cache_id, pos = None, 0
    for end in [*cuts, len(ids)]:
        touching = (image,) if image.offset < end and image.offset + image.length > pos else ()
        (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[pos:end]), cache_id, pos, end == len(ids),
                                                        output=LOGITS, adapter=adapter, images=touching)]))
        cache_id, pos = res.cache.cache_id, end
    ex.release_cache([cache_id])
    return res.output


def test_chunk_boundaries_in_an_image_under_an_adapter_change_nothing(served):
    """Chunked prefill under the adapter (a boundary inside the image's span; Gemma 3's span is written in one
    chunk, so there around it) gives the logits of the whole prompt."""
    family, ckpt, cls, root, ex, ours = served
    ids, (image,) = chat_prompt(ours, [noise_image(90, 40, seed=13)])
    end = image.offset + image.length
    cuts = (image.offset, end) if family == "gemma3" else (image.offset + 3, end - 1)
    whole = _written(ex, ids, image, (), "a")
    chunked = _written(ex, ids, image, cuts, "a")
    assert rel_err(chunked.logits[0], whole.logits[0]) <= 1e-5, family
    base = _written(ex, ids, image, (), "")
    assert rel_err(base.logits[0], whole.logits[0]) > 1e-3, family


def test_embedding_cache_is_shared_across_adapters_but_not_kv(served):
    """A second request with the same image under another adapter reuses the image's embedding (the encoder is
    not adapted) but none of the first one's KV blocks; under the same adapter it reuses every full block."""
    family, ckpt, cls, root, ex, ours = served
    text = "Tell me about the town by the sea and the boats."
    ids, (image,) = chat_prompt(ours, [noise_image(60, 40, seed=12)], text)
    (first,) = raising(ex.unified_decode([UnifiedItem(tuple(ids), adapter="a", images=(image,))]))
    ex.release_cache([first.cache.cache_id])  # its full blocks stay cached, keyed by image and adapter
    span = (ImageInput(image.content_hash, image.offset, image.length, shape=image.shape),)
    bs = ex.kv.block_size
    for adapter, reused in (("a", (len(ids) - 1) // bs * bs), ("b", 0), ("", 0)):
        before = ex.vision_stats()
        (made,) = raising(ex.create_caches([CreateCacheItem(tuple(ids), adapter, images=span)]))
        assert made.cached_tokens == reused, (family, adapter)
        hit = made.cached_tokens
        (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[hit:]), made.cache.cache_id, hit, adapter=adapter,
                                                        images=(image,) if hit < image.offset + image.length else ())]))
        after = ex.vision_stats()
        assert after.images_encoded == before.images_encoded, (family, adapter)  # never encoded again
        if hit < image.offset + image.length:  # the blocks holding the image were computed: from the cached rows
            assert after.embedding_cache_hits > before.embedding_cache_hits, (family, adapter)
        ex.release_cache([res.cache.cache_id])


def test_an_adapter_on_the_vision_encoder_is_refused(served, tmp_path):
    """peft's plain target_modules=["q_proj", "v_proj"] reach the vision tower's q_proj too (and Qwen2.5-VL's
    vision blocks have gate/up_proj): the load fails naming the module and why, and no host path."""
    family, ckpt, cls, root, ex, ours = served
    _, _, targets, module = FAMILIES[family]
    make_peft_adapter(ckpt, root / "enc", r=4, alpha=8, target_modules=targets, seed=3, model_class=cls)
    with pytest.raises(InvalidRequest) as err:
        ex.load_adapter("enc", "enc")
    message = str(err.value)
    assert repr(module) in message and "vision encoder" in message and "language model" in message, message
    assert str(root) not in message and str(tmp_path) not in message
    assert "enc" not in [a.name for a in ex.list_adapters()]
    edit_adapter_config(root / "enc", target_modules=["q_proj", "qkv"])  # Qwen2.5-VL's vision attention's name
    with pytest.raises(InvalidRequest, match=r"\['qkv'\] are not supported.* of the language model"):
        ex.load_adapter("enc", "enc")


def test_older_names_of_the_text_tower_read_the_same(served, tmp_path):
    """The adapter with its keys renamed as older exports name the text tower loads to the same weights; the same
    projection under both names is refused (it would be adapted twice)."""
    import shutil
    family, ckpt, cls, root, ex, ours = served
    new = {"idefics3": "model.text_model.layers."}.get(family, "model.language_model.layers.")
    legacy = tmp_path / "legacy"
    shutil.copytree(root / "a", legacy)

    def rename(tensors):
        for key in list(tensors):
            assert new in key, key
            tensors[key.replace(new, LEGACY[family])] = tensors.pop(key)

    edit_adapter_tensors(legacy, rename)
    # (an older export's patterns were written for its names: these keys match the end of either)
    edit_adapter_config(legacy, rank_pattern={r"layers\.1\.self_attn\.q_proj": 4},
                        alpha_pattern={r"layers\.0\.mlp\.down_proj": 64})
    want = read_adapter(root / "a", ex.model_config, torch.float32, 64)
    got = read_adapter(legacy, ex.model_config, torch.float32, 64)
    assert got.pairs.keys() == want.pairs.keys() and got.targets == want.targets
    assert all(torch.equal(got.pairs[k][0], want.pairs[k][0]) and torch.equal(got.pairs[k][1], want.pairs[k][1])
               for k in want.pairs)
    twice = tmp_path / "twice"
    shutil.copytree(root / "a", twice)
    edit_adapter_tensors(twice, lambda t: t.update({k.replace(new, LEGACY[family]): v.clone()  # (no shared storage)
                                                    for k, v in list(t.items()) if ".layers.0.self_attn.q_proj." in k}))
    with pytest.raises(InvalidRequest, match="layer 0 q_proj is adapted twice"):
        read_adapter(twice, ex.model_config, torch.float32, 64, label="twice")
