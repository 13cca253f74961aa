"""llama.cpp as a benchmark's peer, run from its own binaries (never built or vendored here): finding them
(a directory flag, $LLAMA_BIN_DIR, else PATH), `llama-bench -o json` (prompt processing and generation tok/s) and
`llama-server` as a server the load client (benchmarks/openai_client.py) drives through llama-server's own
/completion route (NATIVE: token ids per chunk without the probabilities its OpenAI routes need to name them)."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from benchmarks.openai_client import Dialect
from benchmarks.request_metrics import Record

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
    """A running llama-server: its `url` (http://127.0.0.1:PORT: /completion, OpenAI routes under /v1), `proc` and
    log file."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    def log(self, tail_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail_chars:] if self.log_path.is_file() else ""

    def slots(self) -> dict[str, Any]:
        """What the server says it made, from its log line `n_slots = N, n_ctx_slot = C, kv_unified = '...'`
        (llama.cpp rounds the context up: C may exceed -c / --parallel); {} if the line is not there."""
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        m = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)(?:, kv_unified = '(\w+)')?", text)
        return {} if m is None else {"n_slots": int(m.group(1)), "n_ctx_slot": int(m.group(2)),
                                     "kv_unified": m.group(3)}

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
    """llama-server on `model_path` with `parallel` slots of `context_per_slot` tokens each (-c parallel x that;
    continuous batching, its default; a KV cache per slot, its default with an explicit --parallel), `threads` for
    generation and prompts alike, no web UI, no host-memory prompt cache (--cache-ram 0: with prompts that share
    nothing it would only copy each finished slot's KV on the serving thread); stopped on the way out."""
    port = free_port()
    cmd = [binary, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * context_per_slot),
           "--cache-ram", "0", "--no-webui"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = LlamaServer(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()


def native_body(prompt: list[int] | str, output_len: int, greedy_exact: bool = True, **extra: Any
                ) -> tuple[str, dict]:
    """llama-server's /completion request: greedy (temperature 0), streamed, each chunk's token ids
    (return_tokens), no probabilities: n_probs > 0 (what its OpenAI routes need for logprobs, the only way they
    name a chunk's tokens) costs llama-server a softmax and a sort of the whole vocabulary per token and slot in its
    one serving thread. greedy_exact: EOS ignored (exactly output_len tokens)."""
    body: dict[str, Any] = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "n_predict": output_len,
                            "temperature": 0, "stream": True, "return_tokens": True, "n_probs": 0, **extra}
    if greedy_exact:
        body["ignore_eos"] = True
    return "/completion", body


def native_note(rec: Record, chunk: dict[str, Any], t: float) -> None:
    """One /completion SSE chunk: its token ids ("tokens"), and on the last one ("stop") the usage and finish
    reason. A token that ends inside a UTF-8 character is held back by the server and its id is never streamed:
    the usage (tokens_predicted) is the count."""
    if "error" in chunk:
        rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return
    ids = [int(i) for i in chunk.get("tokens") or ()]
    if ids:
        rec.messages.append((t, len(ids)))
        rec.output_ids.extend(ids)
    if chunk.get("stop"):
        rec.finish_reason = "length" if chunk.get("stop_type") == "limit" else "stop"
        rec.usage = {"prompt_tokens": chunk["tokens_evaluated"], "completion_tokens": chunk["tokens_predicted"],
                     "cached_tokens": (chunk.get("timings") or {}).get("cache_n", 0), "accepted_tokens": 0,
                     "drafted_tokens": 0}
        if chunk.get("truncated"):
            rec.error = "truncated: the slot's context is full"


NATIVE = Dialect(native_body, native_note)
