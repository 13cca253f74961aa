"""scripts/soak --all (issue 47): the verdict's rules that --all adds, on hand-made records (no process: the rules
are the subject), and, under --long, the whole fleet soaked briefly as a user runs it — a prefill executor, two
decode executors with disk tiers, a TP=2 executor, two schedulers, smg and vllm-router — whose JSON report must say
0 lost, 0 leaked, no 5xx/UNKNOWN/INTERNAL and show chaos done on the fleet. (Not in the default run: the fleet takes
longer to start than the suite can give one test.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.soak.attempts import Attempt
from tests.soak.clients import Record
from tests.soak.cluster import Outage
from tests.soak.verdict import judge, outcome
from tests.soak.workload import Spec

ROOT = Path(__file__).resolve().parents[2]


def _attempt(status: str = "OK", label: str = "ok", text: str = "", at: float = 100.0, tokens=None,
             max_tokens: int = 0) -> Attempt:
    att = Attempt(started=at, stream=False, tokens=tokens, text=text, max_tokens=max_tokens)
    att.ended, att.status, att.label = at + 1.0, status, label
    return att


def test_a_routers_5xx_is_a_failure_only_outside_an_outage():
    spec = Spec(n=1, kind="smg-completion", stream=False, prompt=0, adapter="", seeded=False, route="smg")
    refs = {spec.key: "hello"}
    during = Record(spec, [_attempt("INTERNAL", "http 502", at=100.0), _attempt(text="hello", at=102.0)])
    outside = Record(spec, [_attempt("INTERNAL", "http 502", at=200.0), _attempt(text="hello", at=202.0)])
    v = judge([during, outside], refs, [Outage("scheduler-0", 99.0, 101.0)], t0=0.0)
    assert v.outcomes["completed"] == 2 and not v.lost
    assert dict(v.routed_errors_in_outages) == {"http 502": 1}
    assert [f["at_s"] for f in v.failures] == [200.0]  # the one no outage explains
    # smg's error event when the scheduler under a stream is SIGKILLed: the same rule
    sse = [Record(spec, [_attempt("HTTP_0", "http sse http_0", at=at), _attempt(text="hello", at=at + 2)])
           for at in (100.0, 200.0)]
    v = judge(sse, refs, [Outage("scheduler-1", 99.0, 101.0)], t0=0.0)
    assert dict(v.routed_errors_in_outages) == {"http sse http_0": 1} and len(v.failures) == 1
    direct = Record(Spec(n=2, kind="completion", stream=False, prompt=0, adapter="", seeded=False, route="s0"),
                    [_attempt("INTERNAL", "http 500", at=100.0)])
    assert judge([direct], {}, [Outage("scheduler-0", 99.0, 101.0)], t0=0.0).failures  # a scheduler's own 500


def test_slow_readers_end_stopped_or_whole_and_router_text_ignores_a_held_back_utf8_tail():
    slow = Spec(n=3, kind="grpc", stream=True, prompt=0, adapter="", seeded=False, route="s1", slow=True)
    assert outcome(Record(slow, [_attempt("RESOURCE_EXHAUSTED", "grpc RESOURCE_EXHAUSTED")]), {}) == "slow-stopped"
    assert outcome(Record(slow, [_attempt(tokens=[5] * 8, max_tokens=8)]), {}) == "slow-completed"
    assert outcome(Record(slow, [_attempt(tokens=[5] * 3, max_tokens=8)]), {}) == "wrong-answer"  # cut short
    assert outcome(Record(slow, [_attempt("INTERNAL", "grpc INTERNAL")]), {}) == "status-INTERNAL"
    routed = Spec(n=4, kind="vr-completion", stream=True, prompt=1, adapter="", seeded=False, route="vr")
    assert outcome(Record(routed, [_attempt(text="abc")]), {routed.key: "abc\ufffd"}) == "completed"
    direct = Spec(n=5, kind="completion", stream=True, prompt=1, adapter="", seeded=False, route="s0")
    assert outcome(Record(direct, [_attempt(text="abc")]), {direct.key: "abc\ufffd"}) == "wrong-answer"


@pytest.mark.long
def test_soak_all_smoke(model_dir, tmp_path):
    bin_dir = str(Path(sys.executable).parent)
    if not (shutil.which("smg", path=bin_dir) and shutil.which("vllm-router", path=bin_dir)):
        pytest.fail("smg and vllm-router come with the test extra (smg==1.13.0, vllm-router==0.1.17)")
    out = tmp_path / "soak.json"
    cmd = [str(ROOT / "scripts" / "soak"), "--all", "--minutes", "0.5", "--json", str(out),
           "--log-dir", str(tmp_path / "soak"), "--prompts", "3", "--adapters", "1", "--concurrency", "8",
           "--max-tokens", "8", "--chaos-every", "5", "--session-ttl", "3", "--progress-s", "10",
           "--chaos-all", "kill-executor:1,term-executor:1,kill-scheduler:1,restart-router:1",
           "--executor-args=--decode-kernel torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["failures"] == 0, (report["lost_requests"], report["failure_examples"])
    assert report["leaked"]["blocks"] == 0 and report["leaked"]["caches"] == 0
    assert report["completion"]["equal"] and report["completion"]["completed"] > 0
    assert sum(report["chaos"].values()) >= 2, report["chaos"]
    kinds = set(report["requests"]["by_kind"])
    assert {"grpc", "smg-chat-stream", "vr-completion-stream"} <= kinds, kinds
    assert {r["instance"] for r in report["rss"]["executors"]} >= {"prefill.0", "decode-0.0", "decode-1.0", "tp.0",
                                                                    "tp-rank1.0"}
