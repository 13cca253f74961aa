"""KV transfer of a cache that shows an image between this tree's executor and the previous release's
(tests/contract/previous_release.py), on the tiny Idefics3 checkpoint. A previous release from before image spans
(KvTransferHeader.images, stop 55) sends none and asks for none, so neither side builds a cache that lost its
images — the newer source refuses the older importer naming ExportKvRequest.accept_images, the newer importer
refuses the older source's header naming images_listed (the scheduler recomputes such a request:
docs/kv-transfer.md), and neither keeps a block. A previous release that has them moves the image cache both ways.
A text cache moves both ways in either case."""
from __future__ import annotations

import grpc
import pytest

from tandem.executor.v1 import executor_pb2 as pb
from tests.contract import previous_release as release
from tests.grpc_harness import start_executor, start_for
from tests.vision_checkpoints import noise_image, vision_checkpoint
from tests.vision_greedy import idefics3_greedy

KV = ("--kv-blocks", "64")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def pair(request, ckpt, tmp_path_factory):
    """(this tree's executor, the previous release's), on the same checkpoint and decode step."""
    why = release.unavailable_reason()
    if why:
        pytest.skip(why)
    old_tree = release.extract(tmp_path_factory.mktemp("previous-release"))
    kernel = ("--decode-kernel", "torch") if release.differs("models/native") else ()
    new = start_for(request, ckpt, *KV, *kernel)
    old = start_executor(ckpt, *KV, *kernel, source_root=old_tree)
    request.addfinalizer(old.close)
    assert new.stub.GetInfo(pb.GetInfoRequest()).kv_fingerprint == old.stub.GetInfo(pb.GetInfoRequest()).kv_fingerprint
    knows_images = b"accept_images" in (old_tree / "protos/tandem/executor/v1/executor.proto").read_bytes()
    return new, old, knows_images


@pytest.fixture(scope="module")
def prompt(ckpt):
    ids, image, want = idefics3_greedy(ckpt, noise_image(50, 70, seed=51), 4)
    return ids, image, want


def _prefill(server, ids, images=()) -> str:
    item = pb.UnifiedItem(token_ids=ids, is_final_chunk=True, images=list(images))
    (res,) = server.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[item])).results
    assert res.HasField("output"), res.status
    return res.cache.cache_id


def _decode(server, cache_id: str, seq_len: int, token: int, steps: int) -> list[int]:
    res = server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=cache_id, seq_len=seq_len),
                                                                   token_id=token)], num_steps=steps))
    return [t.token_id for t in res.results[0].output.tokens]


def _refused(importer, source, cache_id: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        importer.stub.ImportKv(pb.ImportKvRequest(source_address=source.address, create_cache=True,
                                                  export=pb.ExportKvRequest(cache_id=cache_id)))
    assert importer.stub.GetInfo(pb.GetInfoRequest()).kv.free_blocks == 64  # nothing kept
    return err.value


@pytest.mark.parametrize("direction", ["new_to_old", "old_to_new"])
def test_an_image_cache_moves_or_is_refused_by_name_between_versions_and_a_text_cache_moves(pair, prompt, direction):
    new, old, knows_images = pair
    source, importer = (new, old) if direction == "new_to_old" else (old, new)
    ids, image, want = prompt
    cache = _prefill(source, ids, [image])
    if knows_images:  # both speak image spans: the cache moves whole and decodes transformers' tokens there
        moved_image = importer.stub.ImportKv(pb.ImportKvRequest(source_address=source.address, create_cache=True,
                                                                export=pb.ExportKvRequest(cache_id=cache)))
        assert moved_image.num_tokens == len(ids)
        assert [want[0]] + _decode(importer, moved_image.cache_id, len(ids), want[0], len(want) - 1) == want
        importer.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[moved_image.cache_id]))
        assert importer.stub.GetInfo(pb.GetInfoRequest()).kv.free_blocks == 64
    else:
        err = _refused(importer, source, cache)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("accept_images" if source is new else "images_listed") in err.details()
    text = _prefill(source, [1] + [(9 + 7 * k) % 300 + 3 for k in range(40)])
    moved = importer.stub.ImportKv(pb.ImportKvRequest(source_address=source.address, create_cache=True,
                                                      export=pb.ExportKvRequest(cache_id=text)))
    assert moved.num_tokens == 41
    source.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cache, text]))
    importer.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[moved.cache_id]))
