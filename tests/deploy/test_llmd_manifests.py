"""deploy/llm-d/ agrees with llm-d and with the servers it runs: the pods carry llm-d's labels
(`llm-d.ai/inferenceServing`, `llm-d.ai/role`), the InferencePool selects exactly those pods and targets the
scheduler's HTTP port (where the OpenAI API and the /metrics llm-d scrapes live), every flag parses with the
real CLIs, the scheduler reaches the executor beside it over the pod's loopback, and the executor publishes
KV events with a topic that names the pod.

Static checks only: PyYAML parses the files, no cluster is needed."""
from __future__ import annotations

import pytest
import yaml

from tests.cli_parsers import ROOT, cli_parser

MANIFEST = ROOT / "deploy" / "llm-d" / "tandem-llm-d.yaml"
DOCS = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]


def _one(kind: str) -> dict:
    found = [d for d in DOCS if d["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)} in {MANIFEST.name}"
    return found[0]


def _container(name: str) -> dict:
    return next(c for c in _one("Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _args(name: str, package: str):
    container = _container(name)
    assert container["command"] == ["python", "-m", package]
    try:
        return cli_parser(package).parse_args([str(a) for a in container["args"]])
    except SystemExit:
        pytest.fail(f"{MANIFEST.name}: the {name}'s flags are rejected by its CLI (see the captured stderr)")


def test_pods_carry_llm_d_labels_and_the_pool_selects_them():
    deployment, pool = _one("Deployment"), _one("InferencePool")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/inferenceServing"] == "true" and labels["llm-d.ai/role"] in ("decode", "both")
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= labels.items(), "the pool must select these pods"
    assert pool["spec"]["endpointPickerRef"]["name"] and pool["spec"]["endpointPickerRef"]["port"]["number"]


def test_the_pool_targets_the_schedulers_http_port():
    scheduler = _args("scheduler", "scheduler")
    [target] = _one("InferencePool")["spec"]["targetPorts"]
    assert target["number"] == scheduler.http_port
    ports = {p["name"]: p["containerPort"] for p in _container("scheduler")["ports"]}
    assert ports["http"] == scheduler.http_port
    assert scheduler.host == "0.0.0.0" and scheduler.served_model_name == [_label("llm-d.ai/model")]


def _label(key: str) -> str:
    return _one("Deployment")["spec"]["template"]["metadata"]["labels"][key]


def test_the_scheduler_drives_the_executor_beside_it_and_events_name_the_pod():
    executor, scheduler = _args("executor", "executor_service"), _args("scheduler", "scheduler")
    assert executor.host == "127.0.0.1", "the executor serves only its pod's scheduler"
    assert scheduler.executor == [f"127.0.0.1:{executor.port}"]
    assert executor.kv_events_endpoint.startswith("tcp://") and ":" in executor.kv_events_endpoint[6:]
    env = {e["name"]: e for e in _container("executor").get("env", [])}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    topic = executor.kv_events_topic
    assert topic.startswith("kv@$(POD_IP):") and topic.endswith(f"@{_label('llm-d.ai/model')}"), topic
