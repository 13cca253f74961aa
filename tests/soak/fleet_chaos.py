"""The chaos of `scripts/soak --all`: actions from a shuffled bag (each in its share, --chaos-all), at random times,
each with requests in flight; the target of each action comes from a shuffled bag of its own (every executor,
scheduler and router is hit in turn, not one of them by luck).

    kill-executor    SIGKILL an executor (prefill, decode-0/1, tp's rank 0), restart it on its ports
    term-executor    SIGTERM an executor: it drains (the schedulers migrate its requests with their KV, the disk
                     tier is flushed) and exits 0; restarted
    kill-scheduler   SIGKILL s0 or s1, restart it on its ports (clients re-send UNAVAILABLE; routers route around)
    term-scheduler   SIGTERM s0 or s1 (running requests get --grace to finish), restart it
    kill-tp-rank     SIGKILL the TP executor's worker rank: rank 0 takes the group down (exit 3), its requests are
                     recomputed on the other executors; restarted
    corrupt-disk     overwrite bytes in a random disk-tier block file (its CRC must catch it: recomputed)
    restart-router   SIGKILL or SIGTERM (in turn) smg or vllm-router, restart it on its port
    adapter          unload an adapter from every LoRA executor (retrying while caches use it), or load it back
"""
from __future__ import annotations

import random
import signal

from tests.soak.fleet import Fleet

ACTIONS = ("kill-executor", "term-executor", "kill-scheduler", "term-scheduler", "kill-tp-rank", "corrupt-disk",
           "restart-router", "adapter")
DEFAULT = "kill-executor:2,term-executor:2,kill-scheduler:1,term-scheduler:1,kill-tp-rank:1,corrupt-disk:2," \
          "restart-router:2,adapter:2"


def parse(text: str) -> dict[str, int]:
    weights = {}
    for part in text.split(","):
        name, _, w = part.partition(":")
        if name.strip() not in ACTIONS:
            raise ValueError(f"unknown --all chaos action {name.strip()!r} (known: {', '.join(ACTIONS)})")
        weights[name.strip()] = int(w or 1)
    if sum(weights.values()) <= 0:
        raise ValueError("--chaos-all has no positive weight (use --chaos-every 0 for no chaos)")
    return weights


def possible(weights: dict[str, int], fleet: Fleet) -> dict[str, int]:
    """The actions this fleet can take (no TP: no kill-tp-rank; no tiers: no corrupt-disk; ...)."""
    can = {"kill-tp-rank": any(s.tp > 1 for s in fleet.specs), "corrupt-disk": fleet.fleet.tiers,
           "restart-router": bool(fleet.routers), "adapter": bool(fleet.cfg.adapters)}
    return {n: w for n, w in weights.items() if can.get(n, True) and w > 0}


class Targets:
    """A shuffled bag per action: each target once before any twice."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._bags: dict[str, list] = {}

    def next(self, action: str, choices: list):
        bag = self._bags.get(action)
        if not bag:
            bag = self._bags[action] = list(choices)
            self.rng.shuffle(bag)
        return bag.pop()


def act(what: str, fleet: Fleet, rng: random.Random, targets: Targets) -> tuple[str, str]:
    """Does one action; returns (the count's name, what happened)."""
    n_exec = list(range(len(fleet.specs)))
    if what in ("kill-executor", "term-executor"):
        i = targets.next(what, n_exec)
        sig = signal.SIGKILL if what == "kill-executor" else signal.SIGTERM
        return f"{what} {fleet.specs[i].name}", fleet.signal_executor(i, sig)
    if what in ("kill-scheduler", "term-scheduler"):
        k = targets.next(what, [0, 1])
        sig = signal.SIGKILL if what == "kill-scheduler" else signal.SIGTERM
        return f"{what} s{k}", fleet.signal_scheduler(k, sig)
    if what == "kill-tp-rank":
        return what, fleet.kill_tp_rank()
    if what == "corrupt-disk":
        return what, fleet.corrupt_disk_block(rng)
    if what == "restart-router":
        name, sig = targets.next(what, [(r, s) for r in fleet.routers for s in (signal.SIGTERM, signal.SIGKILL)])
        return f"restart-router {name} {signal.Signals(sig).name}", fleet.signal_router(name, sig)
    done = fleet.toggle_adapter(rng.choice(sorted(fleet.cfg.adapters)))
    return ("unload-adapter" if "unloaded" in done else "load-adapter"), done
