"""The servicer keeps the event loop free: inputs are size-checked first (no tokenizer time for an oversized
one), then tokenized in a worker thread (the tokenizer releasing the GIL) while other streams keep getting
tokens. Also: what the scheduler logs of an error message is one safe line."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.config import SchedulerConfig
from scheduler.engine.engine import Engine
from tandem.loggable import loggable
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.rpc.servicer import GenerateServicer
from scheduler.text.tokenizer import ModelTokenizer
from tandem.errors import InvalidRequest, SequenceTooLong, TandemError
from tandem.generate.v1 import generate_pb2 as pb
from tests.executor_driver import make_executor
from tests.faulty_executor_client import FaultyExecutorClient
from scheduler.engine.executor_codec import executor_info_from_pb

BIG = 2_000_000  # characters of the large prompt (2 MB): seconds of tokenizing on one core


class CountingTokenizer:
    """The model's tokenizer, noting how many deltas the other stream had received when the encoding of a
    large text started and when it ended."""

    def __init__(self, inner: ModelTokenizer, deltas: list[int]) -> None:
        self._inner = inner
        self._deltas = deltas  # [count], updated by the other stream's reader
        self.seen: tuple[int, int] | None = None
        self.big_encodes = 0

    def encode(self, text: str) -> list[int]:
        if len(text) < BIG:
            return self._inner.encode(text)
        self.big_encodes += 1
        at_start = self._deltas[0]
        ids = self._inner.encode(text)  # seconds of work: on the event loop, or holding the GIL, no delta moves
        self.seen = (at_start, self._deltas[0])
        return ids

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


def test_a_large_prompt_is_tokenized_while_another_stream_gets_tokens(model_dir, tokenizer):
    async def run():
        deltas = [0]
        counting = CountingTokenizer(tokenizer, deltas)
        client = FaultyExecutorClient(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64)))
        engine = Engine(SchedulerConfig("faulty", max_prompt_chars=BIG), client, counting, executor_info_from_pb(client.info_now()))
        engine.grammars = None  # (the servicer's fleet compiles constraints; a bare engine has none)
        engine.images = None  # (nor reads images)
        servicer = GenerateServicer(engine, ThreadPoolExecutor(1))
        loop_task = asyncio.create_task(engine.run())
        try:
            max_new = engine.info.max_seq_len - 4
            long_seq, out = engine.submit(GenerateRequest("long", (1, 7, 8, 9), StoppingCriteria(max_new,
                                                                                               ignore_eos=True)))

            async def read_long():
                while True:
                    # (a plain await: Python 3.11's wait_for can swallow the cancel below when an event arrives
                    # at that moment, and the reader then sits out its whole timeout at asyncio.run's exit)
                    event = await out.events.get()
                    deltas[0] += 1
                    if isinstance(event, TandemError) or event.finish_reason is not None:
                        return

            async def generate_big():
                request = pb.GenerateRequest(text=("hello world " * (BIG // 12 + 1))[:BIG],
                                             stopping=pb.StoppingCriteria(max_new_tokens=1))
                with pytest.raises(SequenceTooLong):  # far longer than the tiny model's length
                    async for _ in servicer.Generate(request, None):
                        pass

            reader = asyncio.create_task(read_long())
            await generate_big()
            at_start, at_end = counting.seen
            assert at_end - at_start >= 3, counting.seen  # the other stream moved while the big one tokenized
            engine.abort(long_seq)
            reader.cancel()

            # past --max-prompt-chars: INVALID_ARGUMENT before any tokenizing
            too_big = pb.GenerateRequest(text="x" * (BIG + 1))
            with pytest.raises(InvalidRequest, match="--max-prompt-chars"):
                async for _ in servicer.Generate(too_big, None):
                    pass
            with pytest.raises(InvalidRequest, match="--max-prompt-chars"):
                await servicer.Tokenize(pb.TokenizeRequest(text="x" * (BIG + 1)), None)
            assert counting.big_encodes == 1
        finally:
            await engine.drain(0)
            loop_task.cancel()

    asyncio.run(run())


def test_logged_error_messages_are_one_line_and_bounded():
    forged = "bad id 'abc\n2024-01-01 INFO tandem.scheduler: all fine\r\x1b[2J'"
    line = loggable(forged)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\\n2024" in line
    assert loggable("x" * 10_000) == "x" * 300 + "..."
