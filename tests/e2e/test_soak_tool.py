"""scripts/soak as a user runs it, briefly: a real subprocess on the tiny model (1 executor, 1 adapter, chaos
every ~3 s with one of each action in the first three; the load goes on until all three
happened, however slowly a loaded machine restarts processes) whose JSON report must say 0 lost, 0 leaked, no
500/UNKNOWN/INTERNAL, and that every kind of chaos happened with requests completing around it. The decode
kernel is the torch one (--executor-args), so this test does not depend on the native build."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_tool_smoke(model_dir, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [str(ROOT / "scripts" / "soak"), "--minutes", "0.3", "--model", str(model_dir), "--json", str(out),
           "--log-dir", str(tmp_path / "soak"), "--executors", "1", "--prompts", "4", "--adapters", "1",
           "--concurrency", "8", "--max-tokens", "8", "--chaos-every", "3",
           "--chaos", "kill-executor:1,kill-scheduler:1,adapter:1", "--min-chaos", "3", "--session-ttl", "2", "--progress-s", "5",
           "--executor-args=--decode-kernel torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "PASSED" in proc.stdout and "LOST requests: 0" in proc.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["lost"] == 0, report["lost_requests"]
    assert report["failures"] == 0, report["failure_examples"]
    assert report["leaked"] == {**report["leaked"], "blocks": 0, "caches": 0}
    chaos = report["chaos"]
    assert chaos.get("kill-executor", 0) >= 1 and chaos.get("kill-scheduler", 0) >= 1, chaos
    assert chaos.get("unload-adapter", 0) + chaos.get("load-adapter", 0) >= 1, chaos
    outcomes = report["requests"]["by_outcome"]
    assert outcomes.get("completed", 0) >= 20, outcomes
    assert set(report["requests"]["by_kind"]) >= {"grpc", "chat-stream", "completion-whole"}
    assert report["references"] > 0 and report["rss"]["scheduler"][0]["start_mb"] > 0
