"""The size of a model call's reply, known from its request before anything runs, so that a reply the server
could not send (over --max-message-mb) is refused before it changes any cache: the caller would never learn
what it created or advanced otherwise.

The estimate is an upper bound: every logits row at its wire dtype, every sampled token with its top
alternatives, a fixed allowance per result (cache id, lengths, status message) and per reply. A multi-step
Decode counts every step (an item may stop early; the bound assumes it does not)."""
from __future__ import annotations

from google.protobuf.message import Message

from tandem.errors import ReplyTooLarge
from tandem.executor.v1 import executor_pb2 as pb
from tandem.sampling_params import MAX_TOP_LOGPROBS

_TOKEN_BYTES = 16  # TokenLogprob: tag + length, token id varint (<= 5), logprob fixed32 (5)
_TOP_BYTES = 16  # one TopLogprob, likewise
_RESULT_BYTES = 512  # per result: cache id (32), lengths, an item status message, the Logits header
_REPLY_BYTES = 256  # KvUsage and framing
_HALF = {pb.LOGITS_DTYPE_BFLOAT16, pb.LOGITS_DTYPE_FLOAT16}
_MAX_STEPS = 256  # the executor refuses more (MAX_DECODE_STEPS); the bound does not outrun that error


def _position_bytes(output: pb.OutputOptions, vocab_size: int) -> int:
    """Upper bound of one sampled position's output under these options."""
    mode = output.mode
    size = 0
    if mode in (pb.OUTPUT_MODE_LOGITS, pb.OUTPUT_MODE_TOKENS_AND_LOGITS):
        size += vocab_size * (2 if output.logits_dtype in _HALF else 4)
    if mode != pb.OUTPUT_MODE_LOGITS:
        size += _TOKEN_BYTES + _TOP_BYTES * min(output.top_logprobs, MAX_TOP_LOGPROBS)
    return size


def reply_bound(method: str, request: Message, vocab_size: int) -> int:
    """Bytes the reply of `method` (an ExecutorService model RPC) to `request` can take at most."""
    if method == "Prefill":
        return _REPLY_BYTES + _RESULT_BYTES + _position_bytes(request.output, vocab_size)
    if method == "ForwardVerify":
        return _REPLY_BYTES + _RESULT_BYTES + len(request.token_ids) * (_position_bytes(request.output, vocab_size) + 8)
    if method == "UnifiedDecode":
        return _REPLY_BYTES + sum(_RESULT_BYTES + (_position_bytes(i.output, vocab_size) if i.is_final_chunk else 0)
                                  for i in request.items)
    if method == "Decode":
        steps = min(max(1, request.num_steps), _MAX_STEPS)
        return _REPLY_BYTES + sum(_RESULT_BYTES + steps * _position_bytes(i.output, vocab_size) for i in request.items)
    return 0  # calls that return no per-position output


def check_reply_size(method: str, request: Message, vocab_size: int, limit_bytes: int) -> None:
    """Raises ReplyTooLarge (RESOURCE_EXHAUSTED) when the reply could exceed the server's message limit."""
    size = reply_bound(method, request, vocab_size)
    if size > limit_bytes:
        raise ReplyTooLarge(
            f"the reply to this {method} could take {size / 2**20:.1f} MiB, over this executor's "
            f"{limit_bytes / 2**20:g} MiB message limit (--max-message-mb); nothing was run: send fewer items, "
            "steps (num_steps) or logits rows per call, or ask for bfloat16 logits (output.logits_dtype)")
