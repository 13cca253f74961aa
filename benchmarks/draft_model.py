"""Draft-model speculation (executor --draft-model): what a draft model costs and the acceptance rate it needs to pay,
measured in process on one executor (its decode step and its draft model), single stream, greedy.

Pairs (--pairs): `self`, the default model (SmolLM2-135M-Instruct) drafting for itself: the upper bound of acceptance
(~100%) at the highest draft cost (the drafter is as big as the target); `random`, a smollm2-1.7b-shaped target and a
smollm2-135m-shaped drafter of one vocabulary, random weights made once (benchmarks/shapes.py): nothing is accepted,
so it shows the cost side of a realistic size ratio. Per pair and draft length k: tokens/s with no drafts (off) and
with k model drafts every step (on: the worst case, drafting whatever the acceptance; a scheduler's keep rule stops
drafting where it does not pay); the measured costs per step (the target's plain step t1, its verify step with k
drafts tv, the draft model's time td); the acceptance rate; and the break-even acceptance: the per-position rate p at
which (1 + p + ... + p^k) t1 = tv + td, with the equivalent accepted/drafted rate. Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import add_sizes, choices, int_list, make_log, model_dir, parse, parser, set_threads
from benchmarks.report import fmt, machine_info, table, write_json
from benchmarks.shapes import shape_checkpoint

DEFAULTS = {"draft_tokens": "2,4", "output_len": 48, "pairs": "self,random"}
QUICK = {"draft_tokens": "2", "output_len": 8, "pairs": "self"}
PAIRS = ("self", "random")
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the sea, the "
          "weather and what the message says.")

log = make_log("bench_draft")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("draft", __doc__, "k 2, 8 tokens, the self pair", model=False)
    add_sizes(ap, DEFAULTS, {"output-len": "tokens decoded per run"})
    ap.add_argument("--draft-tokens", default=None,
                    help=f"comma list of draft lengths k (default {DEFAULTS['draft_tokens']})")
    ap.add_argument("--pairs", default=None, help=f"comma list of {', '.join(PAIRS)} (default {DEFAULTS['pairs']})")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.k_list = int_list(args.draft_tokens, "--draft-tokens")
    args.pair_list = choices(args.pairs, PAIRS, "--pairs")
    return args


def break_even(t1: float, step: float, k: int) -> tuple[float | None, float | None]:
    """(per-position acceptance p, accepted/drafted rate) at which k drafts per step break even: (1 + p + ... + p^k)
    tokens per step of `step` seconds = 1 token per t1. None when even p = 1 does not pay."""
    need = step / t1  # tokens a step must give
    if need > k + 1:
        return None, None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        p = (lo + hi) / 2
        tokens = (1 - p ** (k + 1)) / (1 - p)
        lo, hi = (p, hi) if tokens < need else (lo, p)
    p = hi
    return p, (need - 1) / k  # (accepted per step = need - 1, of k drafted)


def run(ex, prompt: list[int], n_tokens: int, k: int) -> dict[str, Any]:
    """Decodes n_tokens greedily, asking k model drafts per step (0: none). Per-step times exclude the prompt."""
    from executor_service.types import UnifiedItem
    (r,) = ex.unified_decode([UnifiedItem(tuple(prompt))])  # the prompt: not timed
    tokens, cache, length = [r.output.tokens[0].token_id], r.cache.cache_id, r.cache.seq_len
    steps = drafted = accepted = 0
    draft_s = 0.0
    start = time.perf_counter()
    while len(tokens) < n_tokens:
        res = ex.unified_decode([UnifiedItem((tokens[-1],), cache, length, model_draft_tokens=k)])
        (r,) = res
        assert r.error is None, r.error
        got = [t.token_id for t in r.output.tokens]
        tokens += got
        length = r.cache.seq_len
        steps += 1
        drafted += r.model_draft_tokens
        accepted += len(got) - 1
        draft_s += res.draft_model_seconds
    wall = time.perf_counter() - start
    ex.release_cache([cache])
    produced = len(tokens) - 1
    return {"k": k, "tokens": produced, "steps": steps, "wall_s": wall, "tokens_per_s": produced / wall,
            "step_s": wall / steps, "draft_s_per_step": draft_s / steps, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None, "output": tokens[:n_tokens]}


def measure_pair(name: str, target: Path, draft: Path, args, threads: int) -> list[dict[str, Any]]:
    from executor_service.config import ExecutorConfig
    from executor_service.executor import Executor
    ex = Executor(ExecutorConfig(target, device="cpu", kv_blocks=256, progress=False, prefix_caching=False,
                                 draft_model=draft, draft_kv_blocks=64))
    prompt = _prompt(target, ex.model_config.vocab_size)
    run(ex, prompt, 4, 0), run(ex, prompt, 4, 2)  # warm-up: first-call costs out of the timed runs
    rows = []
    for k in args.k_list:
        off = run(ex, prompt, args.output_len, 0)
        on = run(ex, prompt, args.output_len, k)
        off2 = run(ex, prompt, args.output_len, 0)  # A B A: the plain step's time, averaged around the drafting run
        t1 = (off["step_s"] + off2["step_s"]) / 2
        tv = on["step_s"] - on["draft_s_per_step"]
        p, rate = break_even(t1, on["step_s"], k)
        rows.append({"pair": name, "target": target.name, "draft": draft.name, "k": k,
                     "off_tok_s": 2 / (1 / off["tokens_per_s"] + 1 / off2["tokens_per_s"]),
                     "on_tok_s": on["tokens_per_s"], "acceptance": on["acceptance"], "t1_ms": t1 * 1e3,
                     "verify_ms": tv * 1e3, "draft_ms": on["draft_s_per_step"] * 1e3,
                     "break_even_p": p, "break_even_rate": rate, "identical": on["output"] == off["output"],
                     "runs": {"off": _without_output(off), "on": _without_output(on), "off2": _without_output(off2)}})
        log(f"{name} k={k}: off {rows[-1]['off_tok_s']:.2f} tok/s, on {on['tokens_per_s']:.2f} tok/s, "
            f"acceptance {on['acceptance']}")
    return rows


def _without_output(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "output"}


def _prompt(target: Path, vocab: int) -> list[int]:
    """The chat prompt through the model's own tokenizer where it has a chat template; random ids otherwise."""
    from scheduler.text.tokenizer import ChatMessage, ModelTokenizer
    config = target / "tokenizer_config.json"
    if config.is_file() and "chat_template" in config.read_text():
        return ModelTokenizer(target).encode_chat([ChatMessage("user", PROMPT)])
    rng = random.Random(0)  # (a shape checkpoint: the tiny test tokenizer, no template)
    return [rng.randrange(3, min(vocab, 400)) for _ in range(40)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(getattr(args, "threads", None))
    rows = []
    for pair in args.pair_list:
        if pair == "self":
            target = draft = model_dir(None)
        else:
            log("making the random smollm2-1.7b and smollm2-135m shapes (once; ~7 GB)")
            target, draft = shape_checkpoint("smollm2-1.7b"), shape_checkpoint("smollm2-135m")
        rows += measure_pair(pair, target, draft, args, threads)
    print(f"draft-model speculation, in process, single stream, greedy, {args.output_len} tokens per run, "
          f"{threads} threads")
    print(table([{"pair": r["pair"], "target <- draft": f"{r['target']} <- {r['draft']}", "k": r["k"],
                  "off tok/s": fmt(r["off_tok_s"], 2), "on tok/s": fmt(r["on_tok_s"], 2),
                  "on/off": f"{r['on_tok_s'] / r['off_tok_s']:.2f}x",
                  "accept": "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%",
                  "t1 ms": fmt(r["t1_ms"], 1), "verify ms": fmt(r["verify_ms"], 1), "draft ms": fmt(r["draft_ms"], 1),
                  "break-even p (rate)": "never" if r["break_even_p"] is None
                  else f"{r['break_even_p']:.2f} ({100 * r['break_even_rate']:.0f}%)",
                  "identical": "yes" if r["identical"] else "NO"} for r in rows]))
    path = write_json(args.out, {"benchmark": "bench_draft", "config": {k: v for k, v in vars(args).items()
                                                                         if k != "out"} | {"threads": threads},
                                 "machine": machine_info("cpu"), "rows": rows})
    log(f"wrote {path}")
    return 0 if all(r["identical"] for r in rows) else 1
