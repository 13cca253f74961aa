"""The grammar-engine comparison: mask time per step for a batch of matchers, and JSON Schema coverage.

Mask timing: `batch` matchers (the TRAJECTORIES' grammars in turn, each started a few tokens further along
than the previous one so that the batch is not in lockstep) take `steps` steps; each step fills every
matcher's mask with the engine's parallel batch call (timed: the figure the scheduler pays per step), then
every matcher consumes the next token of its grammar's valid output (timed apart), starting over at its end.
Each step also checks that the mask allows the token consumed next (`violations` counts those that did not:
0 for a correct engine). Compile time (compile_all): once per grammar, cold (a fresh engine).

Coverage: a feature is supported when its schema compiles, its valid output is accepted and its invalid one
rejected (an engine that ignores a keyword accepts the invalid output).
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.structured_engines import EngineError
from benchmarks.structured_vocab import Vocabulary
from benchmarks.structured_workloads import FEATURES, TRAJECTORIES
from tandem.token_mask import mask_words


def compile_all(engine) -> tuple[list[Any], list[float]]:
    """Every trajectory's grammar compiled (cold: call it on a fresh engine), and the milliseconds each took."""
    compiled, compile_ms = [], []
    for t in TRAJECTORIES:
        start = time.perf_counter()
        compiled.append(engine.compile(t.kind, t.text))
        compile_ms.append((time.perf_counter() - start) * 1e3)
    return compiled, compile_ms


def time_masks(engine, compiled: list[Any], vocab: Vocabulary, tokenizer, batch: int, steps: int) -> dict[str, Any]:
    paths = [vocab.tokenize(tokenizer, t.output) for t in TRAJECTORIES]
    matchers, pos = [], []
    for i in range(batch):
        k = i % len(TRAJECTORIES)
        m = engine.matcher(compiled[k])
        skip = (3 * (i // len(TRAJECTORIES))) % len(paths[k])
        for tok in paths[k][:skip]:
            engine.advance(m, tok)
        matchers.append(m)
        pos.append(skip)
    masks = np.zeros((batch, mask_words(vocab.n_vocab)), dtype=np.int32)
    fill_s, advance_s, violations = [], [], 0
    for _ in range(steps):
        start = time.perf_counter()
        engine.fill(matchers, masks)
        fill_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            path = paths[i % len(TRAJECTORIES)]
            tok = path[pos[i]]
            if not (int(masks[i, tok // 32]) >> (tok % 32)) & 1:
                violations += 1
            engine.advance(m, tok)
            pos[i] += 1
            if pos[i] == len(path):
                engine.reset(m)
                pos[i] = 0
        advance_s.append(time.perf_counter() - start)
    ms = sorted(x * 1e3 for x in fill_s)
    return {"vocab": vocab.name, "engine": engine.name, "batch": batch, "steps": steps,
            "mask_ms_mean": statistics.fmean(ms), "mask_ms_p50": ms[len(ms) // 2],
            "mask_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "mask_us_per_row": statistics.fmean(ms) * 1e3 / batch,
            "advance_ms_mean": statistics.fmean(advance_s) * 1e3, "violations": violations}


def coverage(engine) -> dict[str, str]:
    """Feature name -> "yes", or why not."""
    out = {}
    for f in FEATURES:
        try:
            compiled = engine.compile("json_schema", json.dumps(f.schema))
        except EngineError as exc:
            out[f.name] = f"no (refused: {str(exc)[:60]})"
            continue
        try:
            ok, bad = engine.accepts(compiled, f.valid), engine.accepts(compiled, f.invalid)
        except Exception as exc:  # an engine failing at run time on a schema it compiled
            out[f.name] = f"no ({type(exc).__name__})"
            continue
        out[f.name] = "yes" if ok and not bad else ("no (rejects valid output)" if not ok
                                                    else "no (accepts invalid output: keyword ignored)")
    return out
