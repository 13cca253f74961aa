"""The native library (models/native/*.cpp): built once per (sources, compiler, torch, flags) with
torch.utils.cpp_extension into a cache directory and loaded into the process. It registers the decode step
(`torch.ops.tandem.decode_step`, `torch.classes.tandem.DecodeModel`: models/decode/native.py) and the block
kernels of the quantized formats (`torch.ops.tandem.block_linear` / `block_dequant`: models/quant/blocks.py).

The library is built by `torch.utils.cpp_extension.load` in a child process (its compiler comes through the
child's environment, and one process loads one library of the op), and installed there atomically;
concurrent executors share it. `python -m models.decode.native` prebuilds it (the image does).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("tandem.native")

SOURCE_DIR = Path(__file__).resolve().parent  # models/native/
SOURCES = ("decode_step.cpp", "op.cpp", "blocks.cpp", "blocks_vnni.cpp")  # (+ the headers they include: every .h in SOURCE_DIR)
NAME = "tandem_decode_step"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")  # cpp_extension adds -fPIC, -std and torch's own
LDFLAGS = ("-fopenmp",)  # libgomp.so.1: at run time the one torch has loaded (the same soname)
CPU_FLAGS = ("avx2", "fma", "f16c")
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tandem" / "native"
BUILD_SECONDS = 30  # the log line's estimate of a first build (measured 22-30 s on 2 busy cores)
BUILD_TIMEOUT_S = 900  # a build that has not finished by then failed (and a lock file that old is stale)
DTYPES = (torch.float32, torch.bfloat16)  # a model's --dtype the step runs (its activations: float32 either way)



@dataclass(frozen=True)
class NativeBuild:
    """How the kernel is built: into cache_dir (None: ~/.cache/tandem/native), with the C++ compiler cxx (a
    name on the PATH or a path; None: $CXX, else g++)."""
    cache_dir: Path | None = None
    cxx: str | None = None

    def compiler_name(self) -> str:
        return self.cxx or os.environ.get("CXX") or "g++"

    def compiler(self) -> str | None:
        """The compiler's path (None: not found)."""
        return shutil.which(self.compiler_name())


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _ninja_dir() -> str | None:
    """The directory of the ninja that cpp_extension runs: the PATH's, else the `ninja` package's (a venv's
    bin/ is not on the PATH of a server started as .venv/bin/python)."""
    found = shutil.which("ninja")
    if found:
        return os.path.dirname(found)
    try:
        import ninja  # the PyPI package (a runtime dependency)
    except ImportError:
        return None
    return ninja.BIN_DIR if os.path.exists(os.path.join(ninja.BIN_DIR, "ninja")) else None


def machine_refusal(build: NativeBuild | None = None) -> str | None:
    """Why this machine cannot run the native step (its CPU, no compiler or ninja); None when it can."""
    build = build or NativeBuild()
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if build.compiler() is None:
        return f"no C++ compiler ({build.compiler_name()}) on the PATH to build it"
    if _ninja_dir() is None:
        return "no ninja (pip install ninja) to build it"
    return None



def _key(cxx: str) -> str:
    """What the library depends on: its sources, the compiler, torch (its headers and ABI), Python and flags."""
    source = b"".join(f.read_bytes() for f in sorted(SOURCE_DIR.iterdir()) if f.suffix in (".cpp", ".h"))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    facts = (os.path.realpath(cxx), version, torch.__version__, sys.version_info[:2], CFLAGS, LDFLAGS)
    return hashlib.sha256(source + repr(facts).encode()).hexdigest()[:16]


# The child's build: torch.utils.cpp_extension.load (ninja, torch's include and library paths and flags);
# loading the library there checks it links.
_BUILD = """
import json, sys
from torch.utils import cpp_extension
try:
    cpp_extension.load(**json.loads(sys.argv[1]), verbose=False, is_python_module=False)
except Exception as exc:  # the reason (a compiler's errors are in its message), not a traceback
    sys.exit(f"{type(exc).__name__}: {exc}")
"""


def build_library(build: NativeBuild | None = None) -> Path:
    """Builds the kernel once per (sources, compiler, torch, flags) into the cache directory and returns the
    library's path (already there: no build). Raises RuntimeError if the build fails or takes over
    BUILD_TIMEOUT_S."""
    build = build or NativeBuild()
    cxx = build.compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({build.compiler_name()}) on the PATH")
    key = _key(cxx)
    directory = build.cache_dir or DEFAULT_CACHE_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: a private directory for this process
        directory = Path(tempfile.mkdtemp(prefix="tandem-native-"))
    target = directory / f"{NAME}-{key}.so"
    if target.exists():
        return target
    work = directory / f"build-{key}"  # cpp_extension's build directory (ninja file, objects, its lock)
    work.mkdir(exist_ok=True)
    lock = work / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > BUILD_TIMEOUT_S:
        lock.unlink(missing_ok=True)  # left by a build that was killed: cpp_extension would wait on it forever
    log.info("building the native decode step (first start, ~%d s)...", BUILD_SECONDS)
    start = time.monotonic()
    env = dict(os.environ, CXX=cxx, PATH=os.pathsep.join(filter(None, (_ninja_dir(), os.environ.get("PATH")))))
    spec = {"name": NAME, "sources": [str(SOURCE_DIR / s) for s in SOURCES], "extra_cflags": list(CFLAGS),
            "extra_ldflags": list(LDFLAGS), "build_directory": str(work)}
    args = [sys.executable, "-c", _BUILD, json.dumps(spec)]
    child = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its own process group: a timeout stops ninja and g++ too
    try:
        output, _ = child.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise RuntimeError(f"building the native decode step took over {BUILD_TIMEOUT_S} s") from None
    if child.returncode != 0:
        raise RuntimeError(f"building the native decode step failed: {output.strip()[-4000:]}")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        shutil.copyfile(work / f"{NAME}.so", tmp)
        os.replace(tmp, target)  # atomic: executors building at once each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the native decode step in %.1f s (%s)", time.monotonic() - start, target)
    return target


_loaded: Path | None = None  # the library whose op this process runs (one: TORCH_LIBRARY registers once)
_load_lock = threading.Lock()


def load_kernel(build: NativeBuild | None = None) -> Path:
    """Builds the kernel (if its cache lacks it) and loads it into this process once; returns the library the
    process runs. A later call with another cache directory builds there but keeps the loaded op (the same
    sources: another library would register torch.ops.tandem a second time)."""
    global _loaded
    with _load_lock:
        path = build_library(build)
        if _loaded is None:
            torch.ops.load_library(str(path))
            _loaded = path
        return _loaded


