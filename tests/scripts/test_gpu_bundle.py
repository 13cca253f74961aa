"""The rehearsal of a lent GPU (issue 46) on the CPU: scripts/gpu_bundle's wheelhouse (LZMA-repacked, as the
real bundle is), installed with no network into a bare venv that holds torch and nothing else, runs
`DIR/run --quick` end to end to gpu_check's table. A dependency the bundle lacks fails here, not on the GPU.

No network: `unshare -n` (a network namespace with only loopback, brought up for the servers' gRPC/HTTP) where
this machine allows one; else a dead proxy for every protocol and PIP_NO_INDEX (any registry access fails). The
wheelhouse (downloaded once per pyproject.toml and gpu_bundle) and the bare venv are cached under
~/.cache/tandem/, so only the first run downloads (minutes); the install and the checks run every time."""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "tandem"
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"
TORCH = torch.__version__.split("+")[0]
KEY = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "scripts" / "gpu_bundle").read_bytes()
                     ).hexdigest()[:12]
# the run's environment: nothing of this test's venv (its packages must not stand in for the bundle's)
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
             and not k.startswith("PIP_")}
# gpu_check runs servers and benchmarks on the CPU, but nothing here asserts a figure or a time (its stages' time
# boxes are three times longer without CUDA), so it runs beside the other tests: a minute or more of waiting on pip
# and on gpu_check that the suite's serial part would add to its wall time.
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU gpu_check runs its CUDA stages")]


def offline_prefix() -> tuple[list[str], dict[str, str], str]:
    """(command prefix, extra environment, how) that cut the network off."""
    probe = subprocess.run(["unshare", "-n", "--", "ip", "link", "set", "lo", "up"], capture_output=True)
    if probe.returncode == 0:
        return ["unshare", "-n", "--", "bash", "-c", 'ip link set lo up && exec "$@"', "offline"], {}, "unshare -n"
    dead = "http://127.0.0.1:9"  # (the discard port: nothing answers)
    return [], {"http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead, "HTTPS_PROXY": dead,
                "ALL_PROXY": dead, "PIP_NO_INDEX": "1"}, "a dead proxy and PIP_NO_INDEX"


@contextmanager
def built_alone(name: str) -> Iterator[None]:
    """Holds an exclusive lock while a cached artefact is checked or built: the suite's workers each run this
    module's fixtures, and two building one directory at once remove each other's files."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def bare_python() -> Path:
    """A venv with torch (this machine's CPU wheel, from its local wheel directory) and only what torch needs."""
    with built_alone("bare-torch"):
        return _bare_python()


def _bare_python() -> Path:
    venv = CACHE / f"bare-torch-{TORCH}-{PYTHON}"
    stamp = venv / ".bare-torch"
    if not stamp.is_file():
        shutil.rmtree(venv, ignore_errors=True)
        base = shutil.which(PYTHON) or getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, env=CLEAN_ENV, timeout=300)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={TORCH}"], check=True,
                       env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
                       timeout=900)
        stamp.write_text(TORCH)
    python = venv / "bin" / "python"
    bare = subprocess.run([str(python), "-c", "import fastapi"], capture_output=True, env=CLEAN_ENV)
    assert bare.returncode != 0, "the bare venv holds fastapi: it no longer tests the bundle"
    return python


@pytest.fixture(scope="module")
def bundle() -> Path:
    """scripts/gpu_bundle for this Python and machine, LZMA-repacked; built once per pyproject.toml and script."""
    with built_alone("gpu_bundle"):
        return _bundle()


def _bundle() -> Path:
    out = CACHE / "gpu_bundle" / f"{PYTHON}-{KEY}"
    for stale in out.parent.glob(f"{PYTHON}-*"):  # bundles of an earlier pyproject.toml or script
        if stale != out:
            shutil.rmtree(stale, ignore_errors=True)
    version = PYTHON.removeprefix("python")
    done = subprocess.run([str(ROOT / "scripts" / "gpu_bundle"), str(out), "--python-version", version,
                           "--compress", "lzma"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MiB in all" in done.stdout and (out / "run").is_file(), done.stdout
    return out


def load_gpu_bundle():
    """scripts/gpu_bundle as a module (a script without .py)."""
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("gpu_bundle", str(ROOT / "scripts" / "gpu_bundle"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_bundle", loader))
    loader.exec_module(module)
    return module


def test_a_manylinux_platform_takes_every_older_tag():
    """pip matches --platform exactly: manylinux_2_35 must also accept the 2_17 (manylinux2014) wheels."""
    tags = load_gpu_bundle().platforms(["manylinux_2_35_x86_64"])
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux_2_5_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "linux_x86_64" not in tags  # (built for one machine only)


def test_the_bundle_holds_no_torch_and_refuses_over_its_limit(bundle):
    names = [w.name for w in bundle.glob("*.whl")]
    assert not [n for n in names if n.lower().startswith(("torch-", "triton-", "nvidia"))], names
    assert (bundle / "provided.txt").read_text().startswith("torch>=")
    over = subprocess.run([str(ROOT / "scripts" / "gpu_bundle"), str(bundle), "--python-version",
                           PYTHON.removeprefix("python"), "--compress", "lzma", "--max-mb", "1"],
                          capture_output=True, text=True, timeout=300)
    assert over.returncode == 3, over.stdout + over.stderr
    assert "over --max-mb 1 MiB" in over.stderr and "the biggest: transformers" in over.stdout, over.stdout


def test_the_default_limit_is_what_travels_less_the_working_tree(bundle):
    """64 MiB a call carries in all: the bundle may take what the checkout's files leave (not a fixed guess)."""
    done = subprocess.run([str(ROOT / "scripts" / "gpu_bundle"), str(bundle), "--python-version",
                           PYTHON.removeprefix("python"), "--compress", "lzma"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"MiB in all \(limit ([\d.]+): 64 MiB a call less the working tree's ([\d.]+) MiB\)", done.stdout)
    assert m, done.stdout
    limit, tree = float(m.group(1)), float(m.group(2))
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    tracked_mib = sum((ROOT / n).stat().st_size for n in tracked.decode().split("\0") if n and (ROOT / n).is_file())
    assert abs(limit + tree - 64) < 0.11 and tree >= tracked_mib / (1 << 20) - 0.05, (limit, tree, tracked_mib)
    # peft and accelerate need torch: carried without their dependencies, installed by DIR/run with --no-deps
    nodeps = (bundle / "requirements-nodeps.txt").read_text().split()
    assert [r.split("==")[0] for r in sorted(nodeps)] == ["accelerate", "peft"], nodeps
    assert "torch" not in (bundle / "requirements.txt").read_text()


def run_offline(bundle_dir: Path, python: Path, site: Path, *flags: str, timeout: float = 600,
                out: Path | None = None) -> subprocess.CompletedProcess:
    """out: gpu_check's $OUT (where a lent machine's table and logs are left)."""
    prefix, env, _ = offline_prefix()
    return subprocess.run([*prefix, str(bundle_dir / "run"), "--site", str(site), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**CLEAN_ENV, **env, "PYTHON": str(python), "TMPDIR": str(site.parent),
                               **({"OUT": str(out)} if out is not None else {})})


def test_the_bundle_runs_gpu_check_on_a_bare_python_without_network(bundle, bare_python, tmp_path):
    """Also the one run of gpu_check's CPU parity stage in the suite (test_gpu_check.py skips its stages)."""
    lent_out = tmp_path / "out"
    lent_out.mkdir()
    proc = run_offline(bundle, bare_python, tmp_path / "site", "--quick", out=lent_out)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"cut off by {offline_prefix()[2]}:\n{out[-6000:]}"
    assert "run: installing" in out and f"run: torch {torch.__version__}: this machine's" in out, out
    assert "no CUDA device here" in proc.stdout
    table = proc.stdout[proc.stdout.rindex("\ndevice "):]
    assert "no CUDA" in table
    for stage, state in (("CUDA tests", "skipped"), ("parity (CPU)", "ran"), ("figures smollm2-135m-2l", "ran"),
                         ("figures smollm2-1.7b", "skipped"), ("serving (smoke)", "ran")):
        assert any(line.startswith(stage) and line.split()[len(stage.split())] == state
                   for line in table.splitlines()), f"{stage} is not {state}:\n{table}"
    rows = {line[:34].strip(): line[34:].split(maxsplit=1) for line in table.splitlines() if line[:1].strip()}
    assert rows["parity (CPU)"][0] == "ran" and "passed" in rows["parity (CPU)"][1], table
    assert rows["CUDA tests"] == ["skipped", "no CUDA"], table
    for figure in ("decode batch 1 ", "prefill 128 tokens", "output tok/s", "TTFT / ITL"):
        assert figure in table, table
    # $OUT: the table and the logs, as a lent machine returns them (plain names, two files)
    assert sorted(p.name for p in lent_out.iterdir()) == ["gpu_check_logs.tar.gz", "gpu_check_table.txt"]
    assert "parity (CPU)" in (lent_out / "gpu_check_table.txt").read_text()
    # the installed site is the bundle's alone: no package from this test's venv; peft beside it (no torch)
    assert not (tmp_path / "site" / "torch").exists()
    assert (tmp_path / "site" / "peft").is_dir() and (tmp_path / "site" / "accelerate").is_dir()


def test_a_wheel_missing_from_the_bundle_fails_the_install(bundle, bare_python, tmp_path):
    """fastapi without opentelemetry-api, as on the first GPU: pip, with no index, refuses before anything runs."""
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in bundle.iterdir():
        if not f.name.startswith("opentelemetry_api-"):
            (partial / f.name).symlink_to(f)
    (partial / "run").unlink()
    shutil.copy(bundle / "run", partial / "run")  # (it finds its wheels beside itself)
    proc = run_offline(partial, bare_python, tmp_path / "site", "--quick", timeout=300)
    assert proc.returncode != 0
    assert "opentelemetry" in proc.stderr and "gpu_check:" not in proc.stdout, proc.stdout + proc.stderr
