"""One gRPC scenario run against an executor to compare tensor-parallel sizes (tests/executor/test_tensor_parallel.py):
a batched, chunked prefill; decode steps of the whole batch; speculative drafts; prompt logprobs over two
chunks; a TruncateCache into a sealed block and decoding
on from there (copy-on-write of a shared block); a CreateCache that reuses cached blocks, then its tail. It
returns every sampled token and its logits, in order."""
from __future__ import annotations

import numpy as np

from tandem.executor.v1 import executor_pb2 as pb

LOGITS = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
PROMPTS = [[1] + [3 + (i * 37) % 390 for i in range(39)], [1, 50, 60, 7, 9], [1, 200, 13]]  # 40, 5, 3 tokens


class Run:
    def __init__(self, stub) -> None:
        self.stub = stub
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []

    def step(self, items: list[pb.UnifiedItem]) -> list[pb.UnifiedResult]:
        results = list(self.stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=items), timeout=60).results)
        for r in results:
            assert not r.status.code, r.status
            if r.HasField("output"):
                self.tokens.extend(t.token_id for t in r.output.tokens)
                if r.output.logits.data:
                    self.logits.append(np.frombuffer(r.output.logits.data, dtype=np.float32).copy())
            for t in r.prompt_logprobs:  # the hidden-states-then-project path (every rank projects its slice)
                self.tokens.extend([t.token_id, t.rank] + [a.token_id for a in t.top_logprobs])
                self.logits.append(np.array([t.logprob] + [a.logprob for a in t.top_logprobs], dtype=np.float32))
        return results


def run_scenario(stub, decode_steps: int = 6) -> Run:
    run = Run(stub)
    p0, p1, p2 = PROMPTS
    # p0 in two chunks (24 then 16 tokens), beside the other two prompts
    first = run.step([pb.UnifiedItem(token_ids=p0[:24], is_final_chunk=False),
                      pb.UnifiedItem(token_ids=p1, is_final_chunk=True, output=LOGITS),
                      pb.UnifiedItem(token_ids=p2, is_final_chunk=True, output=LOGITS)])
    caches = [r.cache.cache_id for r in first]
    lens = [24, len(p1), len(p2)]
    last = [0, run.tokens[0], run.tokens[1]]
    items = [pb.UnifiedItem(cache_id=caches[0], token_ids=p0[24:], pos_offset=24, is_final_chunk=True,
                            output=LOGITS)]
    items += [pb.UnifiedItem(cache_id=caches[i], token_ids=[last[i]], pos_offset=lens[i], is_final_chunk=True,
                             output=LOGITS) for i in (1, 2)]
    for _ in range(decode_steps):
        results = run.step(items)
        lens = [r.cache.seq_len for r in results]
        last = run.tokens[-3:]
        items = [pb.UnifiedItem(cache_id=c, token_ids=[t], pos_offset=n, is_final_chunk=True, output=LOGITS)
                 for c, t, n in zip(caches, last, lens)]
    # drafts verified in the batch (several logit rows, the rejected ones rolled back), then one more step
    (drafted,) = run.step([pb.UnifiedItem(cache_id=caches[1], token_ids=[last[1]], pos_offset=lens[1],
                                          is_final_chunk=True, draft_token_ids=[last[0], 5, 6])])
    run.step([pb.UnifiedItem(cache_id=caches[1], token_ids=[run.tokens[-1]], pos_offset=drafted.cache.seq_len,
                             is_final_chunk=True, output=LOGITS)])
    # prompt logprobs, in two chunks: the forward keeps hidden states, the LM head runs on them in slices
    p3 = [1] + [9 + (i * 53) % 380 for i in range(29)]
    (scored,) = run.step([pb.UnifiedItem(token_ids=p3[:12], is_final_chunk=False, prompt_logprobs=3)])
    (rest,) = run.step([pb.UnifiedItem(cache_id=scored.cache.cache_id, token_ids=p3[12:], pos_offset=12,
                                       is_final_chunk=True, prompt_logprobs=3, output=LOGITS)])
    assert (len(scored.prompt_logprobs), len(rest.prompt_logprobs)) == (11, 18)
    assert len(drafted.output.tokens) >= 1
    caches.append(scored.cache.cache_id)
    # back into p0's second block (sealed, in the prefix cache): the next write copies it first
    run.stub.TruncateCache(pb.TruncateCacheRequest(cache_id=caches[0], new_len=20), timeout=30)
    token = p0[20]
    for pos in range(20, 24):
        run.step([pb.UnifiedItem(cache_id=caches[0], token_ids=[token], pos_offset=pos, is_final_chunk=True,
                                 output=LOGITS)])
        token = run.tokens[-1]
    # a new prompt over p0's first two blocks: they are reused, the tail is computed
    created = run.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=p0 + [7, 8])]),
                                   timeout=30).results[0]
    reused = created.cache.seq_len
    assert reused >= 32, reused
    run.step([pb.UnifiedItem(cache_id=created.cache.cache_id, token_ids=(p0 + [7, 8])[reused:], pos_offset=reused,
                             is_final_chunk=True, output=LOGITS)])
    run.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=caches + [created.cache.cache_id]), timeout=30)
    return run
