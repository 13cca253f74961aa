"""Multi-step decode: when every sequence of a step is only decoding and nothing waits, the executor runs
several decode steps in one call (Decode with num_steps, feeding each sampled token back on the device), so
the per-call cost — the gRPC round trip, both processes' Python, the scheduler's bookkeeping — is paid once
per burst instead of once per token. At batch 1 on a small model that cost is 3-5 ms against a 9-25 ms step
(docs/performance.md).

What it costs: tokens reach the client in bursts (one message per call), and a request arriving during a
burst waits for its end. Both are bounded by time, not by a count: a burst lasts about --decode-burst-ms
(the number of steps whose time, measured per step, comes closest to it; at most --max-decode-steps), so a
slow model (a step longer than 2/3 of the window) keeps one step per call and a fast one gets its overhead
amortised.

Speculative decoding composes with bursts where the executor lists "multi_step_drafts": a burst's
sequences that may draft (scheduler/engine/speculation.py: --speculative-max-batch, no constraint) get
DecodeItem.ngram_drafts with the --speculative settings (the most draft tokens: each sequence's own length,
Speculator.length), and the executor proposes drafts from each one's
own tokens before every step and verifies them in that step's forward (executor_service/step/decode_steps.py), so
a step may return several tokens; max_tokens (the tokens the sequence has left) bounds them. The output is
the one of plain decoding. The drafts the planner made for the step are dropped from a plan that becomes a
burst (the executor drafts its first step too). An executor without the capability: drafts keep steps
single, as below.

A step is one call of one step (UnifiedDecode) whenever any of this holds: a request waits to be admitted
(the burst would hold it back), an item is a prompt chunk or carries draft tokens that the executor cannot
draft within a burst, a sequence's cache has had no final item yet (a recomputed sequence whose
reused prefix covers all but its last token: a UnifiedItem tells the executor where the prompt ends, for
the presence/frequency penalties; a Decode item cannot), a sequence is constrained (its next token mask
needs the grammar after every token), a sequence is short of min_new_tokens (the EOS ban lifts at an exact
step), or the executor does not list the capability "multi_step_decode". Every item stops on the executor
at its EOS and stop token ids; the steps never pass any sequence's max_new_tokens, nor the free KV blocks
the scheduler knows of (the executor ends a burst early, with the steps taken, if the pool fills anyway).
Stop strings are the text's: tokens after one in the same burst are dropped (their cache is released with
the sequence).

A burst the executor refuses as a whole with an error a single step may not meet (its reply over the
executor's --max-message-mb, counted for every step; anything but a lost executor, a forgotten session or
KV exhaustion, which single steps meet the same way) fails no request: nothing ran, the engine's cap on
steps per burst halves (logged) and the step goes again under it; at one step per call it is an ordinary
UnifiedDecode step, whose error ends its requests as any step's does.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from scheduler.config import BurstConfig
from scheduler.engine import executor_codec as codec
from scheduler.executor.client import is_kv_exhaustion
from scheduler.engine.planner import StepPlan
from scheduler.sequence import Sequence
from scheduler.engine.speculation import Speculator
from tandem.capabilities import MULTI_STEP_DECODE, MULTI_STEP_DRAFTS
from tandem.executor.v1 import executor_pb2 as epb
from tandem.errors import RemoteError
from tandem.ceil_div import ceil_div
from tandem.kv_usage import KvUsage

# Errors a single step would meet the same way (the engine's step-error handling covers them): no answer in
# time (lost), a forgotten session or unknown caches (NOT_FOUND), a lost connection (UNAVAILABLE).
_SAME_FOR_ONE_STEP = frozenset({"DEADLINE_EXCEEDED", "NOT_FOUND", "UNAVAILABLE"})
log = logging.getLogger("tandem.scheduler")
_SMOOTHING = 0.3  # weight of the newest call in the per-step time estimate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = BurstConfig()
    g = ap.add_argument_group("multi-step decode (several decode steps per executor call while nothing waits)")
    g.add_argument("--decode-burst-ms", type=float, default=d.window_ms, metavar="MS",
                   help="when every running request is decoding and none waits, the executor runs the number of "
                        "decode steps per call whose time comes closest to this (from the measured step time), "
                        "streaming their tokens as one message: the per-call overhead (3-5 ms on a CPU) is paid "
                        "once per burst. Tokens then arrive in bursts of about this long (at most 1.5x), and a new "
                        f"request waits about that long to start. 0 = one step per call (default {d.window_ms:g})")
    g.add_argument("--max-decode-steps", type=int, default=d.max_steps, metavar="N",
                   help=f"most decode steps per call (1..256; 1 = one step per call; default {d.max_steps})")


def from_args(args: argparse.Namespace) -> BurstConfig:
    return BurstConfig(args.decode_burst_ms, args.max_decode_steps)


class DecodeBursts:
    """Decides each step's number of device-side decode steps, and learns the time one takes."""

    def __init__(self, cfg: BurstConfig) -> None:
        self.cfg = cfg
        self.step_s: float | None = None  # seconds per decode step, calls included (None: none measured yet)
        self.max_steps = cfg.max_steps  # halved by each refused burst
        # The last burst's sequences the executor drafts for: (max draft tokens, n-gram min, n-gram max).
        self.drafting: dict[Sequence, tuple[int, int, int]] = {}

    def refused(self, steps: int, error: RemoteError) -> bool:
        """A burst of `steps` steps was answered with `error`. True: nothing ran and fewer steps may not meet
        it, so the cap halves and the step goes again; False: handle it as a step's error."""
        if steps < 2 or error.status_name in _SAME_FOR_ONE_STEP or is_kv_exhaustion(error):
            return False
        self.max_steps = max(1, steps // 2)  # (steps <= max_steps: steps() caps them)
        log.warning("the executor refused a %d-step decode burst (%s: %s); at most %d steps per burst from now on",
                    steps, error.status_name, error, self.max_steps)
        return True

    def steps(self, plan: StepPlan, waiting: bool, kv: KvUsage, capabilities, speculator: Speculator | None) -> int:
        """Decode steps for this plan's call: 1 = an ordinary UnifiedDecode step. For a burst with speculation,
        also decides self.drafting and drops the planner's drafts from the plan's items (the executor drafts
        within the burst)."""
        cfg = self.cfg
        self.drafting = {}
        inside = speculator is not None and MULTI_STEP_DRAFTS in capabilities  # drafts within bursts
        if (self.max_steps < 2 or not cfg.window_ms or waiting or (speculator is not None and not inside)
                or self.step_s is None or MULTI_STEP_DECODE not in capabilities or not plan.items):
            return 1
        # The count whose time comes closest to the window (not the most that fit in it): a model whose step is
        # 55-65 ms gets 2 steps (~120 ms) per call rather than 1, so its tokens stop paying the call's 3-5 ms each.
        fit = int(cfg.window_ms / 1e3 / self.step_s + 0.5)
        steps = min(self.max_steps, fit)
        for item in plan.items:
            seq = item.seq
            if (item.count != 1 or (item.drafts and not inside) or not seq.is_decoding or not seq.prompt_end_sent
                    or (item.drafts and speculator is not None and speculator.needs_own_step(seq))
                    or item.model_drafts  # (the executor drafts with its draft model in single steps only)
                    or seq.constraint is not None or len(seq.output_ids) < seq.request.stopping.min_new_tokens):
                return 1
            steps = min(steps, seq.tokens_left)
        while steps > 1 and _blocks_for(plan, steps, kv.block_size) > kv.free_blocks:
            steps -= 1
        if steps > 1 and inside:
            self.drafting = speculator.burst_drafting([item.seq for item in plan.items])
            plan.items[:] = [replace(item, drafts=()) if item.drafts else item for item in plan.items]
        return max(1, steps)

    def to_pb(self, plan: StepPlan) -> list[epb.DecodeItem]:
        """The Decode items of the burst steps() decided on."""
        return codec.burst_to_pb(plan, self.drafting)

    def observe(self, plan: StepPlan, steps: int, seconds: float) -> None:
        """A call of `steps` steps took `seconds` (send to answer). Only decode-only plans count: a prompt
        chunk's step says nothing of a decode step's time; a step with drafts is still one forward, about a
        plain step's time while drafts pay at all)."""
        if any(item.count != 1 for item in plan.items):
            return
        per = seconds / max(1, steps)
        self.step_s = per if self.step_s is None else (1 - _SMOOTHING) * self.step_s + _SMOOTHING * per


def _blocks_for(plan: StepPlan, steps: int, block_size: int) -> int:
    """KV blocks the plan's decodes take on for `steps` tokens each."""
    return sum(ceil_div(i.seq.num_cached + steps, block_size) - ceil_div(i.seq.num_cached, block_size)
               for i in plan.items)
