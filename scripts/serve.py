"""Starts the executor (or several) and the scheduler, streams a sample chat answer, prints a grpcurl command,
and keeps serving until Ctrl-C (then stops the scheduler, letting running requests finish, and the executors).

Run through `scripts/serve`, which first bootstraps .venv and prepares the default model:

    scripts/serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:50052
    scripts/serve --prompt "Name three colors."     # another sample question
    scripts/serve --model DIR --port 6000           # another HF model dir / port
    scripts/serve --model model.Q4_K_M.gguf         # a GGUF file as it is (llama.cpp's format)
    scripts/serve --executor-args "--kv-blocks 512" --scheduler-args "--max-running 32"
    scripts/serve --executors 2                     # two executors (:50051, :50053), one scheduler over both
    scripts/serve --http-port 9000                  # the OpenAI-compatible HTTP API on :9000 (-1: none)

--executors N starts N executor processes on consecutive ports from --executor-port (skipping the
scheduler's --port), each with --threads max(1, cores // N) unless --executor-args sets --threads (one
executor keeps torch's default), then one scheduler given `--executor HOST:PORT` once per executor.
With GPUs, give each executor its own: scripts/serve --executors 2 --executor-args "--device cuda:{i}".

The scheduler also serves the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...) on
--http-port (default 8000; -1 = off); a curl command for it is printed with the grpcurl one.

Logs go to --log-dir (default ~/.cache/tandem/logs): executor.log (executor-0.log, ... with several) and
scheduler.log.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # serve_processes beside this file, however this file was loaded
import serve_processes as procs  # noqa: E402
from tandem import server_process  # noqa: E402
from tandem.generate.v1 import generate_pb2 as pb  # noqa: E402
from tandem.generate.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

DEFAULT_PROMPT = "What is the capital of France?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True,
                    help="HF model directory or GGUF file (FILE.gguf: its tokenizer and chat template too); "
                         "scripts/serve passes the default")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address both servers bind (default 127.0.0.1); another one needs TLS or tokens in "
                         "--executor-args/--scheduler-args, or --insecure there (docs/security.md)")
    ap.add_argument("--port", type=int, default=50052, help="scheduler (GenerateService) port (default 50052)")
    ap.add_argument("--http-port", type=int, default=8000,
                    help="the scheduler's OpenAI-compatible HTTP port (default 8000; 0 = any free port; -1 = off)")
    ap.add_argument("--executor-port", type=int, default=50051,
                    help="port of the (first) executor; the others take the next ones, skipping --port "
                         "(default 50051; 0 = each any free port)")
    ap.add_argument("--executors", type=int, default=1, metavar="N",
                    help="executor processes to start, one scheduler driving them all (default 1); with N > 1 "
                         "each gets --threads max(1, cores // N) unless --executor-args sets --threads")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"sample chat question (default {DEFAULT_PROMPT!r})")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="length limit of the sample answer")
    ap.add_argument("--executor-args", default="",
                    help="extra flags for tandem-executor, one quoted string, given to every executor; {i} in it "
                         "becomes the executor's index, e.g. \"--device cuda:{i}\" with --executors 2")
    ap.add_argument("--scheduler-args", default="", help="extra flags for tandem-scheduler, one quoted string")
    ap.add_argument("--log-dir", type=Path, default=Path.home() / ".cache" / "tandem" / "logs")
    ap.add_argument("--no-wait", action="store_true", help="stop after the sample answer (for scripted checks)")
    args = ap.parse_args(argv)
    if args.executors < 1:
        ap.error(f"--executors must be >= 1, got {args.executors}")
    return args


def say(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


def stream_answer(address: str, prompt: str, max_new_tokens: int) -> pb.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
                                 stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))
        print(f"\n>>> {prompt}\n", flush=True)
        last = None
        for last in stub.Generate(req, timeout=600):
            print(last.text, end="", flush=True)
        print("\n", flush=True)
        return last


def grpcurl_hint(address: str) -> str:
    body = json.dumps({"messages": {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
                       "stopping": {"maxNewTokens": 64}})
    grpcurl = ROOT / ".venv" / "bin" / "grpcurl"
    exe = str(grpcurl) if grpcurl.exists() else "grpcurl"
    return f"{exe} -plaintext -d '{body}' {address} tandem.generate.v1.GenerateService/Generate"


def curl_hint(url: str) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 64})
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    logs = args.log_dir
    try:
        ports = procs.executor_ports(args.executor_port, args.executors, avoid=args.port)
    except ValueError as exc:
        say(str(exc))
        return 2
    argvs = procs.executor_argvs(args.model, args.host, ports, shlex.split(args.executor_args), procs.available_cores())
    executors: list[server_process.ServerProcess] = []
    scheduler = None
    try:
        say(f"starting {len(ports)} executor(s) on {args.host}, port {', '.join(map(str, ports))} (loads "
            f"{args.model.name}; log: {logs / ('executor.log' if len(ports) == 1 else 'executor-N.log')})")
        started = time.monotonic()
        executors = procs.start_executors(argvs, logs, say)
        addresses = [e.address for e in executors]
        say(f"executors ready in {time.monotonic() - started:.1f}s at {', '.join(addresses)}; starting the "
            f"scheduler on {args.host}:{args.port} (log: {logs / 'scheduler.log'})")
        scheduler = server_process.launch(
            "scheduler", "scheduler", *procs.scheduler_argv(addresses, args.host, args.port,
                                                            shlex.split(args.scheduler_args),
                                                            http_port=args.http_port if args.http_port >= 0 else None),
            log_path=logs / "scheduler.log", own_session=True)
        http = f", OpenAI-compatible HTTP at {scheduler.http_url}" if scheduler.http_url else ""
        say(f"all healthy: GenerateService at {scheduler.address}{http}, executors at {', '.join(addresses)}")
        last = stream_answer(scheduler.address, args.prompt, args.max_new_tokens)
        if last is not None and last.HasField("usage"):
            say(f"{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} generated tokens")
        print("Try it yourself (the server has reflection: no .proto needed):\n", flush=True)
        print(f"  {grpcurl_hint(scheduler.address)}\n", flush=True)
        if scheduler.http_url:
            print("or over HTTP, the OpenAI way (see docs/serving.md):\n", flush=True)
            print(f"  {curl_hint(scheduler.http_url)}\n", flush=True)
        if args.no_wait:
            return 0
        say("serving; Ctrl-C stops the servers")
        while not stop.wait(1.0):
            for proc in (*executors, scheduler):
                if proc.proc.poll() is not None:
                    say(f"the {proc.name} exited unexpectedly (code {proc.proc.returncode}); log tail:\n{proc.log(4000)}")
                    return 1
        return 0
    except RuntimeError as exc:  # a server did not come up: its log is in the message
        say(str(exc))
        return 1
    finally:
        # The scheduler first: it drains its requests through the executors; then the executors together.
        procs.stop_all([scheduler] if scheduler is not None else [], say)
        procs.stop_all(executors, say)
        if executors:
            say("stopped")


if __name__ == "__main__":
    sys.exit(main())
