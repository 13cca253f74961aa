#!/usr/bin/env python
"""Streams a greedy answer to one chat prompt through the in-process Executor (no network).

    python scripts/sample_answer.py --model DIR [--prompt TEXT] [--max-new-tokens 64]

A smoke check of a model directory: chat template (tokenizer_config.json) -> token ids -> prefill ->
multi-step decode on the device -> text streamed as it is produced.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor_service.config import ExecutorConfig  # noqa: E402
from executor_service.executor import Executor  # noqa: E402
from executor_service.types import CacheRef, DecodeItem  # noqa: E402


def render_chat(model_dir: Path, user_text: str) -> str:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if not template:
        return user_text
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": user_text}],
                                             add_generation_prompt=True, bos_token="", eos_token="")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="HF model directory")
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = ap.parse_args(argv)

    ex = Executor(ExecutorConfig(args.model, device=args.device, kv_blocks=64))
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    ids = tok.encode(render_chat(args.model, args.prompt), add_special_tokens=False).ids
    eos = set(ex.info().eos_token_ids)
    print(f"> {args.prompt}", flush=True)
    start = time.perf_counter()
    res = ex.prefill(ids)
    out = [res.output.tokens[0].token_id]
    printed = ""
    while out[-1] not in eos and len(out) < args.max_new_tokens:
        steps = min(8, args.max_new_tokens - len(out))
        (d,) = ex.decode([DecodeItem(CacheRef(res.cache.cache_id, len(ids) + len(out) - 1), out[-1],
                                     stop_token_ids=frozenset(eos))], num_steps=steps)
        out.extend(t.token_id for t in d.output.tokens)
        text = tok.decode([t for t in out if t not in eos])
        if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
            print(text[len(printed):], end="", flush=True)
            printed = text
    elapsed = time.perf_counter() - start
    print(f"\n[{len(out)} tokens in {elapsed:.2f}s, {len(out) / elapsed:.1f} tok/s]", file=sys.stderr)
    ex.release_cache([res.cache.cache_id])
    return 0


if __name__ == "__main__":
    sys.exit(main())
