"""Shared fixtures: tiny random HF checkpoints (built once per session) and executors over them."""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent

# One OpenMP thread per process, threads that sleep rather than spin when idle: the suite runs several workers
# (scripts/test: pytest-xdist) on few cores, each starting servers, and torch's default of one spinning thread
# per core in every process oversubscribes the cores several times over (measured: 7x the CPU time for the
# same tests). Set before torch is imported here or in any server a test starts (they inherit it); a test
# that needs threads asks for them (--threads, torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the tests marked `long` (the benchmarks' smoke runs through real processes: "
                          "minutes on 2 cores; the default run, as CI, leaves them out)")
    parser.addoption("--no-fork-server", action="store_true",
                     help="start every server as a fresh interpreter instead of forking it from a warm one "
                          "(tests/server_forks.py): slower, for telling a fork-server problem from a product one")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--no-fork-server"):
        from tandem import server_process
        from tests.server_forks import ForkServer
        config._tandem_fork_server = ForkServer()  # type: ignore[attr-defined]
        server_process.use_spawner(config._tandem_fork_server)  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    fork_server = getattr(config, "_tandem_fork_server", None)
    if fork_server is not None:
        from tandem import server_process
        server_process.use_spawner(None)
        fork_server.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Servers of a test marked fresh_process (module-scoped fixtures too: they are set up inside the first
    test's setup, after this hook) start as fresh interpreters."""
    fork_server = getattr(item.config, "_tandem_fork_server", None)
    if fork_server is not None:
        fork_server.enabled = item.get_closest_marker("fresh_process") is None


# The files that take longest (scripts/test's --durations, summed per file), longest first. scripts/test hands
# whole files to its workers (--dist loadfile, so a module's servers start once) in collection order: these,
# collected late, were the run's tail, the other workers idle while one finished them. First they go.
_RUN_FIRST = (
    "tests/benchmarks/test_entry_point.py", "tests/scripts/test_gpu_bundle.py", "tests/executor/test_tensor_parallel.py",
    "tests/e2e/test_deterministic.py", "tests/e2e/test_embeddings_e2e.py", "tests/e2e/test_kv_migration.py",
    "tests/e2e/test_lm_eval.py", "tests/e2e/test_soak.py", "tests/e2e/test_scheduler_prefix_cache.py",
    "tests/executor/test_family_parity.py", "tests/e2e/test_smg_grpc.py", "tests/e2e/test_grpc_hardening.py",
    "tests/e2e/test_scheduler_fleet.py", "tests/executor/test_kv_dtype_grpc.py", "tests/e2e/test_rolling_restart.py",
    "tests/scripts/test_gpu_check.py", "tests/e2e/test_scheduler_speculative.py", "tests/e2e/test_soak_tool.py",
    "tests/e2e/test_scheduler_e2e.py", "tests/e2e/test_gguf_serving.py", "tests/e2e/test_vllm_extensions.py",
    "tests/executor/test_kv_tier_grpc.py", "tests/executor/test_quantization_quality.py",
    "tests/executor/test_host_sharing.py", "tests/e2e/test_vllm_router_kv_aware.py", "tests/contract/test_docs.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {path: rank for rank, path in enumerate(_RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep order
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long: run with --long (scripts/test --long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def load_script(name: str):
    """Imports scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered first, as an import does: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def built_once(tmp_path_factory: pytest.TempPathFactory, kind: str, key: str,
               build: Callable[[Path], Path]) -> Path:
    """build(out_dir) run once per test run for (kind, key), whichever pytest-xdist worker asks first (the
    others wait on a lock, then read what it wrote): each worker building its own copies of every tiny
    checkpoint cost a core-minute per run. A build that failed half-way is redone."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "checkpoints"
    root.mkdir(exist_ok=True)
    name = f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            done.write_text(str(build(out).relative_to(out)))
    return out / done.read_text()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """tiny_checkpoint(arch, **kwargs) -> model dir; each distinct request is built once per run."""
    maker = load_script("make_tiny_checkpoint")

    def make(arch: str, **kwargs) -> Path:
        return built_once(tmp_path_factory, f"tiny-{arch}", f"{arch} {sorted(kwargs.items())!r}",
                          lambda out: maker.make_tiny_checkpoint(arch, out, **kwargs))

    return make


@pytest.fixture(scope="session")
def model_dir(tiny_checkpoint) -> Path:
    """The tiny random Llama most tests run on (a test file may override model_dir with another model)."""
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, converted once per machine into the default cache (scripts/prepare_default_model.py)."""
    prep = load_script("prepare_default_model")
    return Path(prep.prepare())


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """family_checkpoint(family, **config_overrides) -> a tiny checkpoint of one of the families
    (tests/models/family_checkpoints.py); skips when this transformers lacks the family's classes. Each
    distinct request is built once per run."""
    from tests.models.family_checkpoints import make_family_checkpoint, missing_config_class

    def make(family: str, **overrides) -> Path:
        why = missing_config_class(family)
        if why:
            pytest.skip(why)
        return built_once(tmp_path_factory, f"family-{family}", f"{family} {sorted(overrides.items())!r}",
                          lambda out: make_family_checkpoint(family, out, overrides=overrides))

    return make
