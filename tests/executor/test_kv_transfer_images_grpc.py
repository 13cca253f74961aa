"""ExportKv / ImportKv of caches that show images, between real executor processes (issue 48 item 4,
docs/kv-transfer.md): on the tiny Idefics3 and Qwen2.5-VL checkpoints an image prompt prefilled on A and moved to
B (ImportKv with create_cache, as the scheduler's migration does) decodes on B the greedy tokens A decodes without
the transfer, which are transformers' — for Qwen2.5-VL the image's M-RoPE grid travels, so the positions after it
go on right. An importer that does not build image spans (no ExportKvRequest.accept_images: an older executor) is
refused by name, and an executor whose vision encoder differs refuses A's KV (the fingerprint covers it)."""
from __future__ import annotations

import shutil

import grpc
import pytest

from executor_service.kv.fingerprint import differences
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for
from tests.qwen_vl_checkpoint import qwen_vl_checkpoint
from tests.vision_checkpoints import noise_image, vision_checkpoint
from tests.vision_greedy import idefics3_greedy, qwen2_5_vl_greedy

NEW_TOKENS = 6


FAMILIES = {"idefics3": (vision_checkpoint, idefics3_greedy), "qwen2_5_vl": (qwen_vl_checkpoint, qwen2_5_vl_greedy)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint, executor A, executor B, prompt ids, its image, transformers' greedy tokens)."""
    make, reference = FAMILIES[request.param]
    ckpt = make(tmp_path_factory)
    a = start_for(request, ckpt, "--kv-blocks", "64")
    b = start_for(request, ckpt, "--kv-blocks", "64")
    return (ckpt, a, b, *reference(ckpt, noise_image(50, 70, seed=21), NEW_TOKENS))


def _prefill(server, ids, image) -> tuple[str, int]:
    item = pb.UnifiedItem(token_ids=ids, is_final_chunk=True, images=[image])
    (res,) = server.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[item])).results
    assert res.HasField("output"), res.status
    return res.cache.cache_id, res.output.tokens[0].token_id


def _decode(server, cache_id: str, seq_len: int, token: int, steps: int) -> list[int]:
    res = server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=cache_id, seq_len=seq_len),
                                                                   token_id=token)], num_steps=steps))
    return [t.token_id for t in res.results[0].output.tokens]


def _release(server, *cache_ids: str) -> None:
    server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=list(cache_ids)))


def test_a_moved_image_cache_decodes_as_where_it_was_made(family):
    _, a, b, ids, image, want = family
    cache, first = _prefill(a, ids, image)
    moved = b.stub.ImportKv(pb.ImportKvRequest(source_address=a.address, create_cache=True,
                                               export=pb.ExportKvRequest(cache_id=cache, max_chunk_bytes=1)))
    assert moved.num_tokens == len(ids) and moved.blocks_imported == -(-len(ids) // 16)
    there = [first] + _decode(b, moved.cache_id, len(ids), first, NEW_TOKENS - 1)
    here = [first] + _decode(a, cache, len(ids), first, NEW_TOKENS - 1)
    assert there == here == want
    _release(a, cache)
    _release(b, moved.cache_id)


def test_an_importer_that_does_not_build_image_spans_is_refused_by_name(family):
    """What an older executor's ImportKv meets: its ExportKv call sets no accept_images."""
    _, a, _, ids, image, _ = family
    cache, _ = _prefill(a, ids, image)
    with pytest.raises(grpc.RpcError) as err:
        list(a.stub.ExportKv(pb.ExportKvRequest(cache_id=cache)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "accept_images" in err.value.details()
    chunks = list(a.stub.ExportKv(pb.ExportKvRequest(cache_id=cache, accept_images=True)))
    (span,) = chunks[0].header.images
    assert (span.offset, span.length) == (image.offset, image.length) and len(span.content_hash) == 32
    assert chunks[0].header.images_listed
    grid = (span.grid_rows, span.grid_columns)
    assert grid == (tuple(image.shape[:2]) if len(image.shape) == 5 else (0, 0))  # M-RoPE grids only
    _release(a, cache)


@pytest.mark.parametrize("family", ["idefics3"], indirect=True)  # (the digest is the same code for every family)
def test_an_executor_with_another_vision_encoder_refuses_the_kv(request, family, tmp_path):
    """Only the vision tower's weights differ (the text tower is the same): the fingerprint's weights digest
    (every weight file and config.json) differs, and the import is refused naming it."""
    from safetensors.torch import load_file, save_file
    ckpt, a, _, ids, image, _ = family
    other = tmp_path / "other-encoder"
    shutil.copytree(ckpt, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in sorted(weights) if "visual" in k or "vision" in k)
    weights[name] = weights[name] + 0.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    c = start_for(request, other, "--kv-blocks", "64")
    fp_a = a.stub.GetInfo(pb.GetInfoRequest()).kv_fingerprint
    fp_c = c.stub.GetInfo(pb.GetInfoRequest()).kv_fingerprint
    assert differences(fp_c, fp_a).startswith("weights:")
    cache, _ = _prefill(a, ids, image)
    with pytest.raises(grpc.RpcError) as err:
        c.stub.ImportKv(pb.ImportKvRequest(source_address=a.address, create_cache=True,
                                           export=pb.ExportKvRequest(cache_id=cache)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "weights" in err.value.details()
    assert c.stub.GetInfo(pb.GetInfoRequest()).kv.free_blocks == 64
    _release(a, cache)
