"""scripts/soak: flags, and the run step by step on the main thread — model and adapters, the processes, the
clean run, the load with chaos at random times (always with requests in flight) and a progress line every
--progress-s, the drain, the KV check one lease later, the report. Exit 0 when it passed, 1 when it did not
(lost requests, leaked KV, a 500/UNKNOWN/INTERNAL, a process that died by itself), 2 when it could not run.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import random
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.soak import all_options, fleet_chaos, report
from tests.soak.clients import Clients, LoadConfig, Target
from tests.soak.cluster import Cluster, ClusterConfig
from tests.soak.fleet import Fleet
from tests.soak.verdict import EXPECTED, judge, outcome
from tests.soak.workload import DIRECT_ROUTES, ROUTED_KINDS, Mix, make_prompts, parse_kinds

ROOT = Path(__file__).resolve().parents[2]
CHAOS_ACTIONS = ("kill-executor", "kill-scheduler", "adapter")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/soak", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Long soak of real Tandem processes (executors + a scheduler with its HTTP front): a mix of "
                    "gRPC Generate streams and OpenAI chat completions / completions (streaming and not), client "
                    "cancels and HTTP disconnects, LoRA adapters loaded and unloaded, and SIGKILL + restart of any "
                    "process with requests in flight. Greedy and seeded requests must match a clean run taken at "
                    "the start. Reports requests by outcome, lost requests, leaked KV blocks (one lease after the "
                    "end), errors by status, the longest stall, RSS growth per process instance and the chaos "
                    "done; exits 1 unless 0 lost, 0 leaked and no 500/UNKNOWN/INTERNAL (2: could not run).")
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (after the clean run)")
    p.add_argument("--requests", type=int, default=None,
                   help="stop after this many requests instead (--minutes still bounds the time)")
    p.add_argument("--model", default="tiny",
                   help="an HF model directory, 'tiny' (a tiny random Llama built into --log-dir) or 'smollm2' "
                        "(the default model, prepared once into ~/.cache/tandem)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where the servers' logs (NAME.N.log per process instance), the tiny model and the "
                        "adapters go (default None: a new /tmp/tandem-soak-* directory, kept)")
    p.add_argument("--executors", type=int, default=2,
                   help="executor processes (each with --threads cores/(executors+1), unless --executor-args "
                        "sets --threads)")
    p.add_argument("--concurrency", type=int, default=16, help="client workers, each one request at a time")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates (ignore_eos)")
    p.add_argument("--prompts", type=int, default=12, help="distinct prompts (each has a clean-run reference "
                                                          "per protocol, adapter and greedy/seeded)")
    p.add_argument("--adapters", type=int, default=2,
                   help="PEFT LoRA adapters made at the start (loaded on every executor at first)")
    p.add_argument("--mix", default="grpc:4,chat:3,completion:3",
                   help="request kinds by weight: grpc (Generate stream), chat (/v1/chat/completions), "
                        "completion (/v1/completions)")
    p.add_argument("--stream-share", type=float, default=0.6, help="share of HTTP requests that stream (SSE)")
    p.add_argument("--cancel-share", type=float, default=0.15,
                   help="share of requests the client cancels (gRPC) or hangs up on (HTTP) at a random moment")
    p.add_argument("--adapter-share", type=float, default=0.2, help="share of requests naming an adapter")
    p.add_argument("--seeded-share", type=float, default=0.1,
                   help="share of requests sampled with a seed (temperature 0.8), checked like greedy ones")
    p.add_argument("--chaos-every", type=float, default=20.0,
                   help="mean seconds between chaos actions (each 0.5x-1.5x of it; 0 = no chaos)")
    p.add_argument("--chaos", default="kill-executor:2,kill-scheduler:1,adapter:3",
                   help="chaos actions by whole weight (drawn from a shuffled bag, so each comes in its share): "
                        "kill-executor (SIGKILL a random executor, restart it on its port), kill-scheduler (SIGKILL, "
                        "restart on new ports; clients retry there), adapter (unload a random adapter from every "
                        "executor, or load it back)")
    p.add_argument("--min-chaos", type=int, default=0,
                   help="the load goes on past --minutes until this many chaos actions have happened (a slow "
                        "machine restarts processes slowly; at most 3x --minutes more), so a short run still "
                        "exercises every action asked for")
    p.add_argument("--session-ttl", type=float, default=5.0,
                   help="the executors' --session-ttl: a killed scheduler's caches go after it (the KV check "
                        "at the end waits for it)")
    p.add_argument("--kv-blocks", type=int, default=256, help="each executor's --kv-blocks")
    p.add_argument("--retry-s", type=float, default=90.0,
                   help="how long a client re-sends a request that ended UNAVAILABLE (also the scheduler's "
                        "--executor-retry-s)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="deadline of each attempt in seconds (past it: DEADLINE_EXCEEDED, a lost request)")
    p.add_argument("--executor-args", default="",
                   help="extra executor flags, one shell-quoted string, e.g. '--decode-kernel torch'")
    p.add_argument("--scheduler-args", default="", help="extra scheduler flags, one shell-quoted string, "
                                                        "e.g. '--max-waiting 8 --decode-burst-ms 0'")
    p.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, the request mix and the chaos")
    all_options.add_flags(p)
    args = p.parse_args(argv)
    if args.executors < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.prompts < 1:
        p.error("--executors, --concurrency, --max-tokens and --prompts must be >= 1")
    try:
        if args.all:
            all_options.apply_defaults(args, sys.argv[1:] if argv is None else list(argv))
        args.kinds = parse_kinds(args.mix)
        args.chaos_weights = _parse_chaos(args.chaos)
    except ValueError as exc:
        p.error(str(exc))
    if not args.all and any(k in ROUTED_KINDS for k, w in args.kinds if w > 0):
        p.error(f"the request kinds {', '.join(ROUTED_KINDS)} go through the routers of --all")
    return args


def _parse_chaos(text: str) -> dict[str, float]:
    weights = {}
    for part in text.split(","):
        name, _, w = part.partition(":")
        if name.strip() not in CHAOS_ACTIONS:
            raise ValueError(f"unknown chaos action {name.strip()!r} (known: {', '.join(CHAOS_ACTIONS)})")
        weights[name.strip()] = int(w or 1)
    if sum(weights.values()) <= 0:
        raise ValueError("--chaos has no positive weight (use --chaos-every 0 for no chaos)")
    return weights


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resolve_model(model: str, log_dir: Path, max_positions: int | None = None) -> Path:
    if model == "tiny":
        say("building the tiny random Llama checkpoint")
        overrides = {"max_position_embeddings": max_positions} if max_positions else None
        return Path(_script("make_tiny_checkpoint").make_tiny_checkpoint("llama", log_dir / "tiny-llama",
                                                                          config_overrides=overrides))
    if model == "smollm2":
        say("preparing SmolLM2 (converted once into ~/.cache/tandem)")
        return Path(_script("prepare_default_model").prepare())
    path = Path(model).resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"scripts/soak: --model {model}: no config.json there (a directory, 'tiny' or 'smollm2')")
    return path


def make_adapters(model_dir: Path, root: Path, count: int) -> dict[str, Path]:
    if count == 0:
        return {}
    say(f"making {count} PEFT LoRA adapter(s) with peft")
    from tests.lora_fixtures import make_peft_adapter
    return {f"soak{k}": make_peft_adapter(model_dir, root / f"soak{k}", r=4, alpha=8, seed=100 + k)
            for k in range(count)}


class Chaos:
    """Actions in random order at random times, each only while requests are in flight."""

    def __init__(self, cluster: Cluster, clients: Clients, args: argparse.Namespace, t0: float) -> None:
        self.cluster, self.clients, self.t0 = cluster, clients, t0
        self.every = args.chaos_every
        self.fleet = cluster if isinstance(cluster, Fleet) else None
        self.weights = fleet_chaos.possible(args.chaos_all_weights, self.fleet) if self.fleet else args.chaos_weights
        self.adapters = sorted(cluster.cfg.adapters)
        self.rng = random.Random(args.seed + 7)
        self.targets = fleet_chaos.Targets(random.Random(args.seed + 11))
        self.counts: collections.Counter = collections.Counter()
        self.log: list[str] = []
        self._bag: list[str] = []
        self.next_at = self._draw(t0)

    def _next_action(self) -> str:
        """From a shuffled bag holding each action `weight` times, refilled when empty: every action comes
        in its share, e.g. each of three with weight 1 within the first three actions."""
        if not self._bag:
            self._bag = [n for n, w in self.weights.items() for _ in range(w) if n != "adapter" or self.adapters]
            self.rng.shuffle(self._bag)
        return self._bag.pop() if self._bag else ""

    def _draw(self, now: float) -> float:
        return now + self.rng.uniform(0.5, 1.5) * self.every if self.every > 0 else float("inf")

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def act(self) -> None:
        wait_until = time.monotonic() + 10
        while self.clients.in_flight == 0 and time.monotonic() < wait_until:
            time.sleep(0.01)  # with requests in flight, or not at all this time
        what = self._next_action()
        if not what:  # only adapter actions asked for, and no adapters
            self.next_at = float("inf")
            return
        in_flight = self.clients.in_flight
        if self.fleet is not None:
            what, done = fleet_chaos.act(what, self.fleet, self.rng, self.targets)
        elif what == "kill-executor":
            done = self.cluster.kill_executor(self.rng.randrange(self.cluster.cfg.executors))
        elif what == "kill-scheduler":
            done = self.cluster.kill_scheduler()
        else:
            done = self.cluster.toggle_adapter(self.rng.choice(self.adapters))
            what = "unload-adapter" if "unloaded" in done else "load-adapter"
        self.counts[what] += 1
        self.cluster.sample_rss()
        line = f"+{time.monotonic() - self.t0:.0f}s {done} ({in_flight} requests in flight)"
        self.log.append(line)
        say(f"chaos: {line}")
        self.next_at = self._draw(time.monotonic())


def _progress(clients: Clients, chaos: Chaos, cluster: Cluster, t0: float, seen: collections.Counter) -> str:
    done = len(clients.records)
    for rec in clients.records[seen["_n"]:done]:
        seen[outcome(rec, clients.references)] += 1
    seen["_n"] = done
    counts = ", ".join(f"{k} {n}" for k, n in sorted(seen.items()) if k != "_n")
    lost = sum(n for k, n in seen.items() if k != "_n" and k not in EXPECTED)
    sch = cluster.scheduler
    rss = f"{sch.rss_last_kb / 1024:.0f} MB" if sch else "?"
    return (f"+{time.monotonic() - t0:.0f}s: {done} requests done, {clients.in_flight} in flight ({counts}); "
            f"lost so far {lost}; chaos {dict(chaos.counts) or 'none yet'}; scheduler RSS {rss}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="tandem-soak-"))).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = resolve_model(args.model, log_dir, 4096 if args.all else None)
        adapters = make_adapters(model_dir, log_dir / "adapters", args.adapters)
    except Exception as exc:
        print(f"scripts/soak: could not prepare the model or adapters: {exc}", file=sys.stderr)
        return 2
    target = Target()
    cluster_cfg = ClusterConfig(model_dir, args.executors, log_dir / "adapters", adapters, args.session_ttl,
                                args.kv_blocks, shlex.split(args.executor_args), shlex.split(args.scheduler_args),
                                log_dir, args.retry_s)
    if args.all:
        cluster: Cluster = Fleet(cluster_cfg, all_options.fleet_config(args), target, say)
    else:
        cluster = Cluster(cluster_cfg, target, say)
    mix = Mix(kinds=args.kinds, stream_share=args.stream_share, cancel_share=args.cancel_share,
              adapter_share=args.adapter_share, seeded_share=args.seeded_share,
              slow_share=args.slow_share if args.all else 0.0, routes=DIRECT_ROUTES if args.all else ())
    load = LoadConfig(make_prompts(args.prompts, args.seed), tuple(sorted(adapters)), mix, args.concurrency,
                      args.max_tokens, args.request_timeout, args.retry_s, args.seed, args.requests)
    if args.all:
        load.model, load.slow_tokens, load.slow_pause_s = "tiny", args.slow_tokens, all_options.slow_pause_s(args)
        load.retry_routed, load.reference_concurrency = True, 4
    clients = Clients(load, target)
    exit_codes: dict[str, int] = {}
    try:
        cluster.start()
        clients.start()
        say("the clean run: every reference once, one at a time")
        clients.wait_references(timeout=600)
        say(f"{len(clients.references)} references; load for {args.minutes:g} min"
            + (f" or {args.requests} requests" if args.requests else "")
            + f", {args.concurrency} clients, "
            + (f"chaos every ~{args.chaos_every:g} s" if args.chaos_every > 0 else "no chaos"))
        t0 = time.monotonic()
        chaos = Chaos(cluster, clients, args, t0)
        crashed = _load(args, cluster, clients, chaos, t0)
        load_s = time.monotonic() - t0
        say(f"load done after {load_s:.0f} s; waiting one lease ({args.session_ttl:g} s) for the KV check")
        time.sleep(args.session_ttl * 1.25 + 0.5)
        kv = cluster.kv_after_ttl(timeout=3 * args.session_ttl + 10)
    except Exception:
        traceback.print_exc()
        print(f"scripts/soak: the soak could not run to its end; logs in {log_dir}", file=sys.stderr)
        cluster.stop()
        return 2
    finally:
        if not exit_codes:
            exit_codes = cluster.stop()
    verdict = judge(clients.records, clients.references, cluster.outages, t0)
    verdict.leaked_blocks = sum(k.leaked_blocks for k in kv)
    verdict.leaked_caches = sum(k.active_caches for k in kv)
    verdict.crashed = crashed + _unclean_exits(cluster)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("kinds", "chaos_weights", "chaos_all_weights")}
    config["model_dir"] = str(model_dir)
    result = report.build(verdict, cluster, kv, chaos.counts, chaos.log, exit_codes, config, load_s,
                          len(clients.references), time.monotonic())
    print(report.table(result), flush=True)
    if args.json is not None:
        report.write_json(result, args.json)
        say(f"report written to {args.json}")
    return 0 if result["passed"] else 1


def _unclean_exits(cluster: Cluster) -> list[str]:
    """--all: a process the chaos SIGTERMed must drain and exit 0; a TP rank 0 whose worker was SIGKILLed must
    take the group down with exit 3 (anything else: it hung, or died another way)."""
    if not isinstance(cluster, Fleet):
        return []
    out = [f"{name} exited {code} after a chaos SIGTERM" for name, code in cluster.term_exits.items() if code != 0]
    return out + [f"tp rank 0 exited {code} after its worker's SIGKILL (not 3)"
                  for code in cluster.tp_exits if code != 3]


def _load(args: argparse.Namespace, cluster: Cluster, clients: Clients, chaos: Chaos, t0: float) -> list[str]:
    """The load phase: chaos and progress until the time is up (or --requests were sent); then the drain.
    Returns the processes that died by themselves (the soak stops at the first)."""
    deadline = t0 + args.minutes * 60
    next_progress, next_rss = t0 + args.progress_s, t0
    seen: collections.Counter = collections.Counter(_n=0)
    crashed: list[str] = []
    clients.go()
    try:
        # (--min-chaos: past the deadline while fewer actions happened, up to 3x the time more)
        while clients.alive() and (time.monotonic() < deadline or (
                sum(chaos.counts.values()) < args.min_chaos and time.monotonic() < deadline + 3 * (deadline - t0))):
            now = time.monotonic()
            crashed = cluster.dead_processes()
            if crashed:
                say(f"a process died by itself: {crashed}; stopping the load (see its log)")
                break
            if chaos.due(now):
                chaos.act()
            if now >= next_rss:
                cluster.sample_rss()
                next_rss = now + 2.0
            if now >= next_progress:
                say(_progress(clients, chaos, cluster, t0, seen))
                next_progress = now + args.progress_s
            time.sleep(0.05)
    except KeyboardInterrupt:
        say("interrupted: draining and reporting what ran")
    clients.stop()
    say(f"draining {clients.in_flight} requests in flight")
    if not clients.join(timeout=args.request_timeout + args.retry_s + 30):
        raise RuntimeError("the clients did not finish their requests in flight (a hang)")
    if clients.error is not None:
        raise RuntimeError(f"the client thread failed: {clients.error!r}") from clients.error
    cluster.sample_rss()
    say(_progress(clients, chaos, cluster, t0, seen))
    return crashed
