"""deploy/k8s/*.yaml agree with the servers they run: every flag exists in the real CLI, probes and
Services point at the port the server listens on, the scheduler's `dns:///` target names the executors'
headless Service, pods outlive their drain, executors get a GPU and the model volume read-only.

Static checks only: PyYAML parses the files, no cluster, no network, no server started.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import yaml

from tests.cli_parsers import CLI_MODULES, ROOT, cli_parser, known_flags

DEPLOY = ROOT / "deploy" / "k8s"
# kind -> apiVersion; a kind not listed here fails the test until it is added (and checked) on purpose.
API_VERSIONS = {"Namespace": "v1", "PersistentVolumeClaim": "v1", "Service": "v1",
                "StatefulSet": "apps/v1", "Deployment": "apps/v1"}
WORKLOAD_KINDS = ("StatefulSet", "Deployment")


def _documents() -> list[dict]:
    files = sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("*.yml")])
    assert files, f"no manifests under {DEPLOY}"
    docs = []
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:  # an empty document (a trailing ---)
                docs.append({**doc, "_file": path.name})
    return docs


DOCS = _documents()


class Server:
    """One server's workload as the manifests describe it: its pod spec, container and parsed flags."""

    def __init__(self, workload: dict, container: dict, package: str) -> None:
        self.workload = workload
        self.pod = workload["spec"]["template"]["spec"]
        self.container = container
        self.package = package
        argv = [*container.get("command", []), *container.get("args", [])]
        self.flags = [str(a) for a in argv[argv.index("-m") + 2:]] if "-m" in argv else [str(a) for a in argv[1:]]
        self.parser = cli_parser(package)

    def args(self) -> argparse.Namespace:
        try:
            return self.parser.parse_args(self.flags)
        except SystemExit:  # argparse printed why (captured by pytest)
            pytest.fail(f"{self.workload['_file']}: `python -m {self.package} {' '.join(self.flags)}` is rejected by "
                        f"its CLI (see the captured stderr)")

    def container_ports(self) -> dict[str, int]:
        return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in self.container.get("ports", [])}


def _package_of(container: dict) -> str | None:
    argv = [str(a) for a in [*container.get("command", []), *container.get("args", [])]]
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return CLI_MODULES.get(argv[argv.index("-m") + 1])
    return CLI_MODULES.get(Path(argv[0]).name) if argv else None


def _servers(package: str) -> list[Server]:
    found = []
    for doc in DOCS:
        if doc["kind"] in WORKLOAD_KINDS:
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if _package_of(container) == package:
                    found.append(Server(doc, container, package))
    return found


@pytest.fixture(scope="module")
def executor() -> Server:
    servers = _servers("executor_service")
    assert len(servers) == 1, f"want one executor workload (python -m executor_service), found {len(servers)}"
    return servers[0]


@pytest.fixture(scope="module")
def scheduler() -> Server:
    servers = _servers("scheduler")
    assert len(servers) == 1, f"want one scheduler workload (python -m scheduler), found {len(servers)}"
    return servers[0]


def _services_selecting(server: Server) -> list[dict]:
    labels = server.workload["spec"]["template"]["metadata"].get("labels", {})
    return [d for d in DOCS if d["kind"] == "Service" and d["spec"].get("selector")
            and d["spec"]["selector"].items() <= labels.items()
            and d["metadata"].get("namespace") == server.workload["metadata"].get("namespace")]


def _headless_service(executor: Server) -> dict:
    headless = [s for s in _services_selecting(executor) if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1, "want one headless Service (clusterIP: None) selecting the executor pods"
    return headless[0]


def _target_port(service_port: dict, server: Server) -> int:
    target = service_port.get("targetPort", service_port["port"])
    return server.container_ports()[target] if isinstance(target, str) else target


def _probes(server: Server) -> dict[str, dict]:
    return {kind: server.container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")
            if kind in server.container}


def _executor_drain_s() -> float:
    """ServerConfig.grace_s of executor_service/server.py, read from the source (no flag sets it, and
    importing the module would import torch)."""
    tree = ast.parse((ROOT / "executor_service" / "server.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ServerConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", "") == "grace_s":
                    return float(ast.literal_eval(item.value))
    raise AssertionError("ServerConfig.grace_s not found in executor_service/server.py")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['_file']}:{d.get('kind')}/{d.get('metadata', {}).get('name')}")
def test_every_document_is_a_known_kind_with_its_api_version(doc):
    assert doc.get("kind") in API_VERSIONS, f"unexpected kind {doc.get('kind')!r}: add it to API_VERSIONS if meant"
    assert doc.get("apiVersion") == API_VERSIONS[doc["kind"]]
    assert doc.get("metadata", {}).get("name")


def test_everything_lives_in_the_one_namespace():
    namespaces = [d["metadata"]["name"] for d in DOCS if d["kind"] == "Namespace"]
    assert len(namespaces) == 1
    for doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespaces[0], f"{doc['_file']}: {doc['kind']} namespace"


def test_the_workloads_and_services_are_there(executor, scheduler):
    assert executor.workload["kind"] in WORKLOAD_KINDS
    assert scheduler.workload["kind"] == "Deployment"
    headless = _headless_service(executor)
    if executor.workload["kind"] == "StatefulSet":  # its pods' DNS names come from this Service
        assert executor.workload["spec"]["serviceName"] == headless["metadata"]["name"]
    assert not headless["spec"].get("publishNotReadyAddresses", False), "DNS must list only ready executors"
    exposed = [s for s in _services_selecting(scheduler) if s["spec"].get("clusterIP") != "None"]
    assert exposed, "want a Service in front of the scheduler"
    for server in (executor, scheduler):
        selector = server.workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= server.workload["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("which", ["executor", "scheduler"])
def test_every_flag_exists_in_the_servers_cli(which, request):
    server: Server = request.getfixturevalue(which)
    known = known_flags(server.parser)
    for flag in server.flags:
        if flag.startswith("--"):
            assert flag.split("=", 1)[0] in known, f"python -m {server.package} has no flag {flag}"
    args = server.args()  # the whole command line parses: values have the right types, required flags given
    assert args.host == "0.0.0.0", "inside a pod the server must bind 0.0.0.0 (it defaults to loopback)"


@pytest.mark.parametrize("which", ["executor", "scheduler"])
def test_probes_and_services_use_the_port_the_server_listens_on(which, request):
    server: Server = request.getfixturevalue(which)
    port = server.args().port
    assert port in server.container_ports().values(), f"--port {port} is not a containerPort"
    probes = _probes(server)
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}
    for kind in ("startupProbe", "readinessProbe"):
        assert "grpc" in probes[kind], f"{kind} should ask grpc.health.v1"
    for kind, probe in probes.items():
        action = probe.get("grpc") or probe.get("tcpSocket")
        assert action is not None, f"{kind}: grpc or tcpSocket probe expected"
        assert action["port"] == port, f"{kind} probes port {action['port']}, the server listens on {port}"
    args = server.args()
    listening = {port} | {p for p in (getattr(args, "http_port", None), getattr(args, "metrics_port", None)) if p}
    assert listening <= set(server.container_ports().values()), "every port the server opens is a containerPort"
    services = _services_selecting(server)
    assert services
    for service in services:
        ports = {_target_port(service_port, server) for service_port in service["spec"]["ports"]}
        assert port in ports and ports <= listening, f"Service {service['metadata']['name']}"


def test_metrics_ports_are_announced_for_scraping(executor, scheduler):
    for server in (executor, scheduler):
        args = server.args()
        annotations = server.workload["spec"]["template"]["metadata"]["annotations"]
        scraped = int(annotations["prometheus.io/port"])
        assert scraped in (getattr(args, "metrics_port", None), getattr(args, "http_port", None))


def test_scheduler_resolves_the_headless_service(executor, scheduler):
    assert "--executor" in known_flags(scheduler.parser)
    values = scheduler.args().executor
    values = values if isinstance(values, list) else [values]  # --executor becomes repeatable
    dns = [v for v in values if v.startswith("dns:///")]
    assert dns, f"the scheduler's --executor should be a dns:/// target, got {values}"
    host, _, port = dns[0].removeprefix("dns:///").rpartition(":")
    service = _headless_service(executor)
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert host in (f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"), \
        f"--executor {dns[0]} does not name the headless Service {name} in namespace {namespace}"
    service_ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert int(port) in service_ports, f"--executor port {port} is not a port of Service {name}"
    assert _target_port(service_ports[int(port)], executor) == executor.args().port


def test_pods_outlive_their_drain(executor, scheduler):
    grace = scheduler.args().grace
    assert scheduler.pod["terminationGracePeriodSeconds"] > grace, "the scheduler pod must outlive --grace"
    assert executor.pod["terminationGracePeriodSeconds"] > _executor_drain_s()
    # A liveness probe failing during the drain (health NOT_SERVING) must not kill the executor early.
    live = executor.container["livenessProbe"]
    assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) >= _executor_drain_s()


def test_startup_probes_allow_for_slow_starts(executor, scheduler):
    def budget(server: Server) -> int:
        probe = server.container["startupProbe"]
        return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert budget(executor) >= 600, "loading weights can take minutes: give the executor's startup probe time"
    # The scheduler listens only once an executor serves: waiting for one is not a failed start.
    assert budget(scheduler) > scheduler.args().connect_timeout


def test_executor_requests_a_gpu(executor):
    resources = executor.container.get("resources", {})
    limit = resources.get("limits", {}).get("nvidia.com/gpu")
    assert limit is not None and int(limit) >= 1, "the executor needs resources.limits nvidia.com/gpu (>= 1)"
    requested = resources.get("requests", {}).get("nvidia.com/gpu")  # extended resources: requests == limits
    assert requested is None or requested == limit


@pytest.mark.parametrize("which", ["executor", "scheduler"])
def test_model_volume_is_mounted_read_only(which, request, executor):
    server: Server = request.getfixturevalue(which)
    mounts = {m["mountPath"]: m for m in server.container.get("volumeMounts", [])}
    assert mounts.get("/models", {}).get("readOnly") is True
    volume = next(v for v in server.pod["volumes"] if v["name"] == mounts["/models"]["name"])
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert any(d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim for d in DOCS)
    # The scheduler reads the tokenizer from the model directory the executor reports.
    assert Path(executor.args().model).is_relative_to("/models")
