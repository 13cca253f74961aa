"""ImportKv's network half: this executor calls ExportKv on the source executor and turns the stream into the
(header, blocks) chunks executor_service/kv/transfer/pinned_export.py imports. The link follows the project's exposure rule, from the client
side: a source off loopback is dialled only over TLS (--peer-tls*), or in plaintext with --insecure; the token
of --peer-token-file goes with the call. The source's errors come back with its own status code (RemoteError),
except that a source that cannot be reached or goes away mid-stream is UNAVAILABLE, whatever gRPC saw."""
from __future__ import annotations

from typing import Iterator

import grpc

from executor_service.kv.transfer.image_spans import TransferImage
from executor_service.kv.transfer.pinned_export import BlockPayload, TransferHeader
from executor_service.kv.transfer.config import KvTransferConfig
from tandem.errors import CacheStateConflict, InvalidRequest, RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc
from tandem.security.posture import is_loopback
from tandem.security.tls import ClientTls, client_paths
from tandem.security.tokens import ClientToken

_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def split_address(address: str) -> tuple[str, int]:
    """host:port (IPv6 in brackets) -> (host, port); InvalidRequest otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 255:
        raise InvalidRequest("source_address must be host:port (IPv6 as [addr]:port), e.g. 10.0.0.7:50051")
    return host, int(port)


class PeerLink:
    """How this executor dials other executors (the settings are read once, at start)."""

    def __init__(self, cfg: KvTransferConfig, max_message_bytes: int) -> None:
        self.cfg = cfg
        self.max_message_bytes = max_message_bytes
        self._tls = ClientTls(client_paths(cfg.peer_tls_ca, cfg.peer_tls_cert, cfg.peer_tls_key)) \
            if cfg.peer_uses_tls else None
        self._token = ClientToken(cfg.peer_token_file, "--peer-token-file") if cfg.peer_token_file else None

    def channel(self, address: str) -> grpc.Channel:
        host, _ = split_address(address)
        opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]
        if self._tls is not None:
            return grpc.secure_channel(address, self._tls.credentials(), options=opts)
        if not is_loopback(host) and not self.cfg.insecure:
            raise CacheStateConflict(f"source {host!r} is not on loopback and this executor has no TLS for its peers "
                                     "(--peer-tls-ca / --peer-tls): refused (or start it with --insecure)")
        return grpc.insecure_channel(address, options=opts)

    def pull(self, address: str, request: pb.ExportKvRequest,
             timeout_s: float) -> Iterator[tuple[TransferHeader | None, list[BlockPayload]]]:
        """The source's export as chunks. Closing the generator cancels the call (the source unpins)."""
        channel = self.channel(address)
        metadata = self._token.metadata() if self._token is not None else None
        call = pb_grpc.ExecutorServiceStub(channel).ExportKv(request, timeout=timeout_s, metadata=metadata)
        try:
            for chunk in call:
                yield header_from_pb(chunk), [BlockPayload(b.block_hash, b.index, b.num_tokens, b.data, b.crc32c)
                                              for b in chunk.blocks]
        except grpc.RpcError as exc:
            code = exc.code()
            if code in _GONE:
                raise Unavailable(f"the source executor at {address} is unreachable or went away mid-transfer "
                                  f"({code.name}); nothing was imported") from None
            raise RemoteError(code.name, f"the source executor at {address}: {exc.details()}") from None
        finally:
            call.cancel()
            channel.close()


def header_from_pb(chunk: pb.KvChunk) -> TransferHeader | None:
    if not chunk.HasField("header"):
        return None
    h = chunk.header
    images = tuple(TransferImage(i.offset, i.length, i.content_hash,
                                 (i.grid_rows, i.grid_columns) if i.grid_rows or i.grid_columns else None)
                   for i in h.images)
    return TransferHeader(h.kv_fingerprint, h.block_size, h.num_tokens, tuple(h.token_ids), h.adapter, h.num_blocks,
                          images, h.images_listed)


def chunk_to_pb(header: TransferHeader | None, blocks: list[BlockPayload]) -> pb.KvChunk:
    msg = pb.KvChunk(blocks=[pb.KvBlock(block_hash=b.hash, index=b.index, num_tokens=b.num_tokens, data=b.data,
                                        crc32c=b.crc) for b in blocks])
    if header is not None:
        msg.header.CopyFrom(pb.KvTransferHeader(kv_fingerprint=header.fingerprint, block_size=header.block_size,
                                                num_tokens=header.num_tokens, token_ids=header.token_ids,
                                                adapter=header.adapter, num_blocks=header.num_blocks,
                                                images=[_image_to_pb(im) for im in header.images],
                                                images_listed=header.images_listed))
    return msg


def _image_to_pb(im: TransferImage) -> pb.KvImageSpan:
    rows, cols = im.grid or (0, 0)
    return pb.KvImageSpan(offset=im.offset, length=im.length, content_hash=im.content_hash, grid_rows=rows,
                          grid_columns=cols)
