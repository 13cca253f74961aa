"""The image spans a KV transfer carries (executor_service/kv/transfer/image_spans.py), in process on the tiny
Idefics3 checkpoint: a cache cut after an image moves and finishes its prompt on the importer with the image's
hash in its blocks' prefix-cache keys (a prompt with the same image reuses them past the image, another image does
not); and the importer refuses, keeping nothing, the headers it cannot honour: an older exporter's (no span list)
whose tokens hold the image token, a chain of prefix-cache blocks showing an image (the prefix cache keeps no
spans), an M-RoPE grid on a model without M-RoPE, a span past the tokens, too many spans."""
from __future__ import annotations

from dataclasses import replace

import pytest

from executor_service.kv.transfer.image_spans import MAX_TRANSFER_IMAGES, TransferImage
from executor_service.types import CreateCacheItem, ImageInput, UnifiedItem
from scheduler.text.tokenizer import ModelTokenizer
from scheduler.vision.chat_images import ChatImages
from scheduler.vision.media_policy import MediaPolicy
from tandem.errors import CacheStateConflict
from tests.executor_driver import make_executor, raising
from tests.vision_checkpoints import noise_image, vision_checkpoint
from tests.vision_harness import chat_prompt

TEXT = "Tell me about the town by the sea and the boats, the fish and the nets."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def ex(ckpt):
    return make_executor(ckpt)


@pytest.fixture(scope="module")
def prompt(ckpt):
    ours = ChatImages.load(ckpt, MediaPolicy()), ModelTokenizer(ckpt)
    return chat_prompt(ours, [noise_image(50, 70, seed=41)], TEXT)


def _altered(chunks, **changes):
    """The export's chunks with its header changed (what another exporter would have sent)."""
    for header, blocks in chunks:
        yield (replace(header, **changes) if header is not None else None), blocks


def _prefill(ex, ids, images, end=None) -> str:
    end = len(ids) if end is None else end
    (res,) = raising(ex.unified_decode([UnifiedItem(tuple(ids[:end]), None, 0, end == len(ids), images=images)]))
    return res.cache.cache_id


def test_a_moved_cache_finishes_its_prompt_there_with_image_keyed_blocks(ex, prompt):
    """Cut just after the image, inside the block where its span ends: the rest of the prompt brings no image,
    so only the spans the transfer carried key that block when the importer seals it."""
    ids, items = prompt
    (im,) = items
    bs = ex.kv.block_size
    end = im.offset + im.length
    cut = end + 2
    assert im.offset // bs < end // bs == cut // bs < len(ids) // bs  # the span runs over blocks; cut in its last
    part = _prefill(ex, ids, items, cut)
    moved = ex.transfer.import_(ex.transfer.export(part, (), "", accept_images=True), True, "")
    raising(ex.unified_decode([UnifiedItem(tuple(ids[cut:]), moved.cache_id, cut, True)]))
    ex.release_cache([part, moved.cache_id])  # the finished cache's full blocks stay indexed

    def reused(content_hash: str) -> int:
        span = ImageInput(content_hash, im.offset, im.length, shape=im.shape)
        (res,) = raising(ex.create_caches([CreateCacheItem(tuple(ids), images=(span,))]))
        ex.release_cache([res.cache.cache_id])
        return res.cached_tokens

    assert reused(im.content_hash) == len(ids) // bs * bs  # (the blocks the importer sealed, keyed by the image)
    assert reused("0" * 32) == im.offset // bs * bs  # another image: only the blocks before its span


def test_an_older_exporters_header_with_image_tokens_is_refused(ex, prompt):
    ids, items = prompt
    cache = _prefill(ex, ids, items)
    free = ex.kv.allocator.num_free
    chunks = _altered(ex.transfer.export(cache, (), "", accept_images=True), images=(), images_listed=False)
    with pytest.raises(CacheStateConflict, match="images_listed"):
        ex.transfer.import_(chunks, True, "")
    assert ex.kv.allocator.num_free == free
    ex.release_cache([cache])


def test_a_chain_of_blocks_that_show_an_image_is_refused(ex, prompt):
    ids, items = prompt
    cache = _prefill(ex, ids, items)
    hashes = list(ex.cache_table("").get(cache).table.hashes)  # (as a router has them from the KV events)
    with pytest.raises(CacheStateConflict, match="image token"):
        ex.transfer.import_(ex.transfer.export("", hashes, ""), False, "")
    ex.release_cache([cache])


@pytest.mark.parametrize("change,named", [
    ("grid", "no M-RoPE"),
    ("past", "starts past"),
    ("many", f"at most {MAX_TRANSFER_IMAGES}"),
    ("hash", "content_hash"),
])
def test_spans_the_importer_cannot_honour_are_refused_keeping_nothing(ex, prompt, change, named):
    ids, items = prompt
    cache = _prefill(ex, ids, items)
    (im,) = items
    span = TransferImage(im.offset, im.length, im.content_hash, None)
    images = {"grid": (replace(span, grid=(2, 2)),),
              "past": (replace(span, offset=len(ids)),),
              "many": tuple(TransferImage(k, 1, im.content_hash, None) for k in range(MAX_TRANSFER_IMAGES + 1)),
              "hash": (replace(span, content_hash="X" * 32),)}[change]
    free = ex.kv.allocator.num_free
    with pytest.raises(CacheStateConflict, match=named):
        ex.transfer.import_(_altered(ex.transfer.export(cache, (), "", accept_images=True), images=images), True, "")
    assert ex.kv.allocator.num_free == free
    ex.release_cache([cache])
