"""deploy/k8s/tensor-parallel/40-executor-lws.yaml agrees with the executor's CLI and with LeaderWorkerSet: every
flag parses (LWS's $(VAR) placeholders filled with sample values), the group size equals
--tensor-parallel-size, every rank joins the leader's rendezvous with its own LWS index, the leader alone serves
gRPC and the headless Service selects leaders only, off-loopback links carry --insecure (refused without it).

Static checks only: PyYAML parses the file, no cluster, no server started."""
from __future__ import annotations

import re

import pytest
import yaml

from executor_service.tp.launch import TpLaunch
from tests.cli_parsers import ROOT, cli_parser

MANIFEST = ROOT / "deploy" / "k8s" / "tensor-parallel" / "40-executor-lws.yaml"
SAMPLE_ENV = {"LWS_LEADER_ADDRESS": "tandem-executor-0.tandem-executor.tandem", "LWS_WORKER_INDEX": "1",
              "LWS_GROUP_SIZE": "2"}


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def _args(container: dict) -> list[str]:
    assert container["command"] == ["python", "-m", "executor_service"]
    return [re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)], str(a)) for a in container["args"]]


@pytest.fixture(scope="module")
def ranks(docs) -> list:
    lws = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    parser = cli_parser("executor_service")
    return [parser.parse_args(_args(_container(lws[t]))) for t in ("leaderTemplate", "workerTemplate")]


def test_it_is_a_leaderworkerset_whose_group_size_is_the_tensor_parallel_size(docs, ranks):
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost rank takes its group down
    assert all(r.tensor_parallel_size == template["size"] for r in ranks)


def test_every_rank_joins_the_leaders_rendezvous_with_its_own_index(ranks):
    leader, worker = (TpLaunch.from_args(r) for r in ranks)
    assert leader.master == worker.master == f"{SAMPLE_ENV['LWS_LEADER_ADDRESS']}:29500"
    assert (leader.rank, worker.rank) == (0, 1)
    assert leader.join_timeout_s >= 300  # pods of one group may start minutes apart


def test_off_loopback_links_need_insecure(ranks):
    for args in ranks:
        assert args.insecure
        args.insecure = False
        with pytest.raises(ValueError, match="--insecure"):
            TpLaunch.from_args(args)
        args.insecure = True


def test_the_leader_serves_grpc_and_the_service_selects_leaders_only(docs):
    lws = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader, worker = _container(lws["leaderTemplate"]), _container(lws["workerTemplate"])
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports["grpc"] == 50051 and ports["tp-rendezvous"] == 29500
    assert leader["readinessProbe"]["grpc"]["port"] == 50051
    assert "ports" not in worker and "readinessProbe" not in worker
    service = docs["Service"]
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert all(lws["leaderTemplate"]["metadata"]["labels"].get(k) == v for k, v in selector.items()
               if not k.startswith("leaderworkerset"))
    assert lws["workerTemplate"]["metadata"]["labels"]["app.kubernetes.io/name"] != selector["app.kubernetes.io/name"]
