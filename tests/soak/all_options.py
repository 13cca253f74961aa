"""The flags of `scripts/soak --all` (the whole fleet: tests/soak/fleet.py) and what they turn into: the fleet's
parts (--no-tp, --no-roles, --no-tiers, --no-smg, --no-vllm-router, --no-routers), its chaos (--chaos-all,
tests/soak/fleet_chaos.py), slow readers, and the defaults --all changes (a request mix through the routers too,
fewer prompts, a smaller KV pool so that the disk tiers fill)."""
from __future__ import annotations

import argparse

from tests.soak import fleet_chaos
from tests.soak.fleet import FleetConfig

# No vr-chat by default: vllm-router 0.1.17 adds SGLang's fields to every chat request it forwards (no_stop_trim,
# separate_reasoning, stream_reasoning, return_hidden_states, ...), which the HTTP front refuses as unknown (400).
# --mix can add it (to see that 400).
ALL_MIX = "grpc:3,chat:2,completion:2,smg-chat:1,smg-completion:1,vr-completion:2"
# --all's own defaults for flags the plain soak has (a flag given on the command line wins)
ALL_DEFAULTS = {"prompts": 8, "kv_blocks": 320, "retry_s": 120.0, "request_timeout": 300.0}


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "--all: every part of the stack at once",
        "A prefill executor, two decode executors (--role), each with a KV disk tier, a tensor-parallel executor "
        "(TP=2, rank 1 a child of rank 0; TP refuses LoRA and tiers), two schedulers over all of them, and smg "
        "(gRPC) and vllm-router "
        "(kv_aware) in front; requests go to either scheduler directly or through a router, some are slow readers. "
        "Chaos (--chaos-all, drawn from a shuffled bag, each target in turn): kill-executor = SIGKILL an executor "
        "and restart it; term-executor = SIGTERM (the executor drains: its requests migrate with their KV to the "
        "others; its disk tier is flushed) and restart; kill-scheduler / term-scheduler = SIGKILL / SIGTERM (drain "
        "within --grace) of s0 or s1 and restart on its ports; kill-tp-rank = SIGKILL the TP worker rank (rank 0 "
        "must take the group down, exit 3; its requests are recomputed elsewhere); corrupt-disk = overwrite bytes "
        "of a disk-tier block file (its CRC must catch it); restart-router = SIGKILL or SIGTERM of smg or "
        "vllm-router and restart; adapter = unload/load a LoRA adapter on the executors that take adapters (TP "
        "refuses LoRA). Turn parts off with the --no-* flags (their chaos and request kinds go with them).")
    g.add_argument("--all", action="store_true", help="soak the whole fleet (see above) instead of --executors N")
    g.add_argument("--no-tp", action="store_true", help="no tensor-parallel executor (and no kill-tp-rank)")
    g.add_argument("--no-roles", action="store_true",
                   help="the three executors serve both phases (no prefill/decode hand-offs)")
    g.add_argument("--no-tiers", action="store_true", help="no KV disk tiers (and no corrupt-disk)")
    g.add_argument("--no-routers", action="store_true", help="neither smg nor vllm-router (machines without them)")
    g.add_argument("--no-smg", action="store_true", help="no smg (its request kinds and restarts go)")
    g.add_argument("--no-vllm-router", action="store_true", help="no vllm-router (its request kinds and restarts go)")
    g.add_argument("--chaos-all", default=fleet_chaos.DEFAULT,
                   help="--all's chaos actions by whole weight: " + ", ".join(fleet_chaos.ACTIONS))
    g.add_argument("--slow-share", type=float, default=0.005,
                   help="--all: share of requests that are slow readers (a gRPC or SSE chat stream with top-20 "
                        "logprobs that reads one message, then nothing for 2x --stall-timeout-s + 2 s): each must "
                        "end stopped by the scheduler (RESOURCE_EXHAUSTED) or whole, and free its KV")
    g.add_argument("--slow-tokens", type=int, default=512,
                   help="--all: a slow reader's max tokens (--all's tiny model takes 4096 positions)")
    g.add_argument("--stall-timeout-s", type=float, default=5.0,
                   help="--all: the schedulers' --stream-stall-timeout-s")
    g.add_argument("--grace", type=float, default=10.0, help="--all: the schedulers' --grace (a SIGTERMed one's "
                                                             "streams get this long to finish)")
    g.add_argument("--kv-disk-gb", type=float, default=0.02, help="--all: each executor's --kv-disk-gb")


def apply_defaults(args: argparse.Namespace, argv: list[str]) -> None:
    """--all's defaults for flags not given, the mix without the routers turned off, the chaos parsed."""
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    for name, value in ALL_DEFAULTS.items():
        if name not in given:
            setattr(args, name, value)
    if args.no_routers:
        args.no_smg = args.no_vllm_router = True
    if "mix" not in given:
        args.mix = ",".join(part for part in ALL_MIX.split(",")
                            if not (args.no_smg and part.startswith("smg-"))
                            and not (args.no_vllm_router and part.startswith("vr-")))
    args.chaos_all_weights = fleet_chaos.parse(args.chaos_all)


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    return FleetConfig(tp=not args.no_tp, roles=not args.no_roles, tiers=not args.no_tiers, smg=not args.no_smg,
                       vllm_router=not args.no_vllm_router, stall_timeout_s=args.stall_timeout_s, grace_s=args.grace,
                       kv_disk_gb=args.kv_disk_gb)


def slow_pause_s(args: argparse.Namespace) -> float:
    return 2 * args.stall_timeout_s + 2.0
