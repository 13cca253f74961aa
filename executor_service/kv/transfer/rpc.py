"""ExportKv and ImportKv, between the servicer (executor_service/rpc/servicer.py) and the transfer itself (executor_service/kv/transfer/pinned_export.py): request
checks, chunk limits, the link to the source executor (executor_service/kv/transfer/client.py) and proto conversion."""
from __future__ import annotations

import grpc

from executor_service.executor import Executor
from executor_service.kv.transfer.pinned_export import DEFAULT_CHUNK_BYTES, MAX_CHAIN
from executor_service.kv.transfer.client import PeerLink, chunk_to_pb, split_address
from tandem.errors import InvalidRequest
from tandem.executor.v1 import executor_pb2 as pb

_HEADROOM = 256 << 10  # a chunk's header and framing, beside its blocks' bytes
DEFAULT_IMPORT_TIMEOUT_S = 600.0  # when the ImportKv caller set no deadline


def check_export(request: pb.ExportKvRequest) -> None:
    if bool(request.cache_id) == bool(request.block_hashes):
        raise InvalidRequest("ExportKvRequest needs exactly one of cache_id and block_hashes")
    if len(request.block_hashes) > MAX_CHAIN:
        raise InvalidRequest(f"ExportKvRequest names {len(request.block_hashes)} block hashes; at most {MAX_CHAIN}")


class KvTransferRpc:
    def __init__(self, ex: Executor, max_message_bytes: int) -> None:
        self.ex = ex
        self.max_message_bytes = max_message_bytes
        self.peers = PeerLink(ex.config.kv_transfer, max_message_bytes)

    def _chunk_limit(self, asked: int) -> int:
        return max(1, min(asked or DEFAULT_CHUNK_BYTES, self.max_message_bytes - _HEADROOM))

    def export(self, request: pb.ExportKvRequest, context: grpc.ServicerContext):
        check_export(request)
        chunks = self.ex.transfer.export(request.cache_id, list(request.block_hashes), request.session_id,
                                         self._chunk_limit(request.max_chunk_bytes), request.accept_images)
        try:
            for header, blocks in chunks:
                if not context.is_active():  # the importer went away: unpin now
                    return
                yield chunk_to_pb(header, blocks)
        finally:
            chunks.close()

    def import_(self, request: pb.ImportKvRequest, context: grpc.ServicerContext) -> pb.ImportKvResponse:
        split_address(request.source_address)
        if not request.HasField("export"):
            raise InvalidRequest("ImportKvRequest.export is required: the cache_id or block_hashes to pull")
        check_export(request.export)
        export = pb.ExportKvRequest()
        export.CopyFrom(request.export)
        export.max_chunk_bytes = self._chunk_limit(export.max_chunk_bytes)  # what this side may receive
        export.accept_images = True  # this importer builds the header's image spans (kv/transfer/image_spans.py)
        remaining = context.time_remaining()  # None, or ~2^63 s, when the caller set no deadline
        timeout = DEFAULT_IMPORT_TIMEOUT_S if remaining is None else max(0.1, min(remaining, DEFAULT_IMPORT_TIMEOUT_S))
        chunks = self.peers.pull(request.source_address, export, timeout)
        try:
            res = self.ex.transfer.import_(chunks, request.create_cache, request.session_id)
        finally:
            chunks.close()
        return pb.ImportKvResponse(cache_id=res.cache_id, num_tokens=res.num_tokens,
                                   blocks_imported=res.blocks_imported, bytes=res.bytes)
