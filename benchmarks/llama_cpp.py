"""llama.cpp as a benchmark's peer, run from its own binaries (never built or vendored here): finding them
(a directory flag, $LLAMA_BIN_DIR, else PATH), `llama-bench -o json` (prompt processing and generation tok/s) and
`llama-server` as an OpenAI-compatible endpoint the load client can drive like Tandem's."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

BIN_DIR_ENV = "LLAMA_BIN_DIR"


def find_binary(name: str, bin_dir: str | Path | None = None, explicit: str | None = None) -> str | None:
    """Path of llama.cpp's `name` (llama-bench, llama-quantize, llama-server): `explicit`, else in `bin_dir`, else
    in $LLAMA_BIN_DIR, else on PATH; None when none is found."""
    if explicit:
        return explicit
    for directory in (bin_dir, os.environ.get(BIN_DIR_ENV)):
        if directory and (Path(directory) / name).is_file():
            return str(Path(directory) / name)
    return shutil.which(name)


def llama_bench(binary: str, model_path: Path, prompt_len: int, gen: int, threads: int, repeats: int
                ) -> dict[str, Any]:
    """llama.cpp's llama-bench (`-o json`) on a file: its pp test (a prompt of `prompt_len` tokens; 0: none) and tg
    test (`gen` tokens from an empty context; 0: none), `repeats` repetitions each. Returns its rows and
    pp_tok_s / tg_tok_s (None for a test not run)."""
    out = subprocess.run([binary, "-m", str(model_path), "-p", str(prompt_len), "-n", str(gen), "-t", str(threads),
                          "-r", str(repeats), "-o", "json"], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}) on {model_path}: {out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    pp = next((r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"]), None)
    tg = next((r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"]), None)
    return {"llama_bench": rows, "pp_tok_s": pp, "tg_tok_s": tg}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A running llama-server: its `url` (http://127.0.0.1:PORT, OpenAI routes under /v1), `proc` and log file."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    def log(self, tail_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail_chars:] if self.log_path.is_file() else ""

    def wait_ready(self, timeout: float) -> None:
        """Until GET /health answers 200 (the model loaded); RuntimeError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready after {timeout:.0f}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def llama_server(binary: str, model_path: Path, threads: int, parallel: int, context_per_slot: int,
                 log_path: Path, ready_timeout: float = 900.0) -> Iterator[LlamaServer]:
    """llama-server on `model_path` with `parallel` slots of `context_per_slot` tokens each (continuous batching,
    its default), `threads` for generation and prompts alike, no web UI; stopped on the way out."""
    port = free_port()
    cmd = [binary, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * context_per_slot), "--no-webui"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = LlamaServer(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()
