"""The decode benchmark's llama.cpp side comes from llama.cpp's own llama-bench (`-o json`): a stand-in binary
that prints what llama-bench prints shows the call and how its pp / tg rows become TTFT and decode tok/s."""
from __future__ import annotations

import json
import sys

from benchmarks.decode import decode_peer


def test_llama_bench_rows_become_ttft_and_decode_rate(tmp_path):
    rows = [{"n_prompt": 128, "n_gen": 0, "avg_ts": 640.0}, {"n_prompt": 0, "n_gen": 64, "avg_ts": 80.0}]
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(tmp_path / 'argv')!r}, 'w').write("
                    f"json.dumps(sys.argv[1:]))\nprint(json.dumps({rows!r}))\n")
    fake.chmod(0o755)
    out = decode_peer(str(fake), tmp_path / "m.gguf", 128, 64, threads=2, repeats=3)
    assert out["decode_tok_s"] == 80.0 and out["ttft_ms"] == 200.0 and out["llama_bench"] == rows
    argv = json.loads((tmp_path / "argv").read_text())
    assert argv == ["-m", str(tmp_path / "m.gguf"), "-p", "128", "-n", "64", "-t", "2", "-r", "3", "-o", "json"]
