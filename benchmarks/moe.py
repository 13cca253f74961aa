"""MoE decode benchmark: Tandem vs transformers on one Qwen3-MoE checkpoint, in the same run.

No real Qwen3-MoE checkpoint is available offline, so by default this builds a synthetic one with random
weights (scripts/make_tiny_checkpoint.py + config overrides) shaped like a scaled-down Qwen3-30B-A3B:
hidden 256, 8 layers, all sparse, 16 experts top-2, moe_intermediate_size 128, 8 heads / 2 KV heads of 32,
vocab 8192. It then runs scripts/bench_forward.py (decode at batch 1, 8, 32; prefill off) on it: same
timing, alternation, table and JSON. FLOPs count what a token actually computes: the router plus top_k
experts (3 x hidden x moe_intermediate_size each) per MoE layer, not all the experts' weights.

    python scripts/bench_moe.py                                  # synthetic checkpoint in a temp dir
    python scripts/bench_moe.py --model /path/to/Qwen3-30B-A3B   # any Qwen3-MoE checkpoint
    python scripts/bench_moe.py --quick --out /tmp/moe.json      # other flags go to bench_forward.py

Benchmark-only (needs transformers); never imported by the servers.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import forward
from benchmarks.flops import MoeFlopModel

SYNTHETIC = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=32, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=8192)
SYNTHETIC_LAYERS = 8
DEFAULT_ARGS = ["--batches", "1,8,32", "--prefill-len", "0", "--out", "bench_results/bench_moe.json"]


def build_synthetic(out: Path) -> Path:
    import make_tiny_checkpoint  # a sibling script; needs transformers + tokenizers
    return make_tiny_checkpoint.make_tiny_checkpoint("qwen3_moe", out, num_layers=SYNTHETIC_LAYERS,
                                                     config_overrides=SYNTHETIC)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--model", type=Path, default=None, help="a Qwen3-MoE checkpoint (default: build a synthetic one)")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.help:
        print(__doc__)
        return 0
    with tempfile.TemporaryDirectory(prefix="tandem-bench-moe-") as tmp:
        model = args.model or build_synthetic(Path(tmp) / "qwen3-moe-synthetic")
        # later flags win in argparse: the user's override the defaults
        return forward.main(["--model", str(model), *DEFAULT_ARGS, *rest], flop_model=MoeFlopModel)
