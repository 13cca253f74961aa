"""Frees ride with the step (capability release_with_step), engine over the real in-process executor: while
requests run, finished ones' caches leave inside the next step call (no ReleaseCache of its own); a step
call that fails takes its releases back (they go with a later call: nothing leaks); an executor without the
capability gets ReleaseCache calls as before (tests/faulty_executor_client.py plays one; its tests cover it)."""
from __future__ import annotations

import asyncio

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.text.tokenizer import ModelTokenizer
from tandem.errors import RemoteError
from tests.executor_driver import make_executor
from tests.scheduler.engine_harness import Running, collect, tokens

LENGTHS = [3, 6, 9, 12, 15]  # each request ends at another pass while the longer ones still run


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


class Counting(InProcessExecutorClient):
    """The in-process client, recording each call (and the releases a step call carried); optionally the
    first step call that carries releases fails as a KV-full executor would answer it, before running."""

    def __init__(self, executor, fail_first_release: bool = False) -> None:
        super().__init__(executor)
        self.calls: list[tuple[str, int]] = []  # (method, release_cache_ids carried)
        self.failed_release: list[str] = []  # what the failed step call carried
        self.released: list[str] = []  # ids carried by calls that succeeded (step calls and ReleaseCache)
        self._fail = fail_first_release

    async def unified_decode(self, items, session_id: str = "", release=()):
        self.calls.append(("UnifiedDecode", len(release)))
        if release and self._fail:
            self._fail, self.failed_release = False, list(release)
            raise RemoteError("RESOURCE_EXHAUSTED", "executor in-process: KV cache full (injected)")
        self.released += release
        return await super().unified_decode(items, session_id, release=release)

    async def decode(self, items, num_steps, session_id: str = "", release=()):
        self.calls.append(("Decode", len(release)))
        self.released += release
        return await super().decode(items, num_steps, session_id, release=release)

    async def release(self, cache_ids, session_id: str = ""):
        self.calls.append(("ReleaseCache", len(cache_ids)))
        self.released += cache_ids
        return await super().release(cache_ids, session_id)

    async def keep_alive(self, session_id: str):
        self.calls.append(("KeepAlive", 0))
        return await super().keep_alive(session_id)


def _requests() -> list[GenerateRequest]:
    # min_new_tokens = max: one decode step per pass (EOS banned), so each request ends at its own pass
    return [GenerateRequest(f"r{n}", (1, 5 + n, 9 + n, 13), StoppingCriteria(new, min_new_tokens=new))
            for n, new in enumerate(LENGTHS)]


async def _serve(client, tokenizer) -> list[list[int]]:
    async with Running(client, tokenizer) as engine:  # (on exit: every KV block must be free again)
        outs = [engine.submit(r)[1] for r in _requests()]
        return [tokens(await collect(o)) for o in outs]


def test_finished_caches_ride_with_the_next_step_call(model_dir, tokenizer):
    client = Counting(make_executor(model_dir, kv_blocks=64))
    assert "release_with_step" in client.info_now().capabilities
    got = asyncio.run(_serve(client, tokenizer))
    assert [len(t) for t in got] == LENGTHS
    methods = [m for m, _ in client.calls]
    last_step = max(i for i, m in enumerate(methods) if m in ("UnifiedDecode", "Decode"))
    # while requests ran, only step calls; the releases of the first four rode with them
    assert set(methods[:last_step + 1]) <= {"UnifiedDecode", "Decode"}, methods
    assert sum(n for m, n in client.calls[:last_step + 1]) == len(LENGTHS) - 1
    # the last request's cache: no step follows, so a ReleaseCache of its own (or at drain)
    assert methods[last_step + 1:].count("ReleaseCache") <= 1


def test_a_failed_step_call_keeps_its_releases_for_a_later_call(model_dir, tokenizer):
    plain = asyncio.run(_serve(Counting(make_executor(model_dir, kv_blocks=64)), tokenizer))
    client = Counting(make_executor(model_dir, kv_blocks=64), fail_first_release=True)
    got = asyncio.run(_serve(client, tokenizer))  # Running's exit checks that no block leaked
    assert got == plain  # (the KV-full answer preempted one request: recomputed to the same tokens)
    assert client.failed_release, "the injected failure hit a step call that carried releases"
    assert set(client.failed_release) <= set(client.released)  # sent again with a later call
