"""Speculative-decoding benchmark: one executor (prefix caching off) and two schedulers, --speculative off and
--spec-args (default: auto), the same chat requests through each one's OpenAI front in A B B A order, on a
copy-heavy and a plain chat workload at several concurrencies, and a repeat workload (each question asked, then
asked again: the second answer repeats the first, which its prompt does not contain); greedy output must be
identical. Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from typing import Any

from benchmarks import openai_client
from benchmarks.cli import add_sizes, choices, int_list, make_log, parse, parser, serving_setup
from benchmarks.measure import summarize
from benchmarks.report import fmt, machine_info, model_json, table, write_json
from benchmarks.request_metrics import Record
from tandem import server_process

DEFAULTS = {"concurrency": "1,8,32", "output_len": 128, "rounds": 1, "workloads": "copy,chat,repeat"}
QUICK = {"concurrency": "1,2", "output_len": 16, "rounds": 1, "workloads": "copy,chat,repeat"}
COUNTERS = ("tandem:spec_decode_num_drafts_total", "tandem:spec_decode_num_draft_tokens_total",
            "tandem:spec_decode_num_accepted_tokens_total")
WORKLOADS = ("copy", "chat", "repeat")
# Fixed texts (nothing downloaded): copy prompts combine an instruction with a passage, so that up to 36 distinct
# prompts copy much of themselves; chat questions copy nothing.
PASSAGES = (
    "The river runs through the old town, past the mill and the church, and under seven stone bridges. In spring "
    "the water rises and the fishermen wait on the banks for the trout to return from the sea. In summer children "
    "swim near the mill, and in autumn the leaves of the chestnut trees float slowly towards the harbour.",
    "Our team meets every Monday at nine to plan the week. Each engineer says what they finished, what they will "
    "do next and what blocks them. The meeting lasts fifteen minutes. Notes are written in the shared document, "
    "and anything that needs a longer discussion is moved to a separate call on Tuesday afternoon.",
    "To reset your password, open the settings page and choose Security. Click on Change password, type your "
    "current password, then type the new password twice. The new password must have at least twelve characters. "
    "After you save it, you will be signed out of every other device and asked to sign in again.",
    "The library opens at eight in the morning and closes at ten in the evening from Monday to Friday. On "
    "weekends it opens at ten and closes at six. Books can be borrowed for three weeks and renewed twice online. "
    "Students need their card to enter the reading rooms on the second and third floors.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n        total += value\n"
    "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
    "            result.append(total / window)\n    return result\n",
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n\n    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n            raise KeyError(name)\n"
    "        self.items[name] -= count\n\n    def total(self):\n        return sum(self.items.values())\n",
)

COPY_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy the following text and change nothing:\n\n{}",
    "Rewrite the following text exactly as it is, keeping every line:\n\n{}",
    "Here is a text. Return it unchanged.\n\n{}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{}",
    "Return the following text again, in full:\n\n{}",
)

CHAT_QUESTIONS = (
    "Write a short poem about the autumn wind.",
    "Explain how a bicycle works to a ten year old.",
    "Give three tips for learning a new language.",
    "What are the benefits of drinking water every day?",
    "Describe a quiet morning in a small village.",
    "How do I make a cup of tea?",
    "Why is the sky blue? Answer in a few sentences.",
    "Suggest a name for a friendly robot and explain why.",
    "What should I pack for a weekend hiking trip?",
    "Write a short story about a cat who finds a key.",
    "How can I stay focused while working from home?",
    "Explain what a computer program is.",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Describe the sound of rain on a roof.",
    "Why do people keep diaries?",
)

log = make_log("bench_spec")


def prompts(workload: str, n: int) -> list[str]:
    """n distinct chat prompts; consecutive copy prompts copy different passages."""
    if workload == "copy":
        pool = [COPY_INSTRUCTIONS[(i // len(PASSAGES)) % len(COPY_INSTRUCTIONS)].format(PASSAGES[i % len(PASSAGES)])
                for i in range(len(PASSAGES) * len(COPY_INSTRUCTIONS))]
    elif workload == "repeat":  # (asked twice each; worded unlike the chat cell's, so the first ask is a first)
        pool = [f"{q} Answer in a few sentences." for q in CHAT_QUESTIONS] + [
            f"Please answer: {q}" for q in CHAT_QUESTIONS]
    else:
        pool = list(CHAT_QUESTIONS) + [f"{q} Keep it brief." for q in CHAT_QUESTIONS]
    if n > len(pool):
        raise SystemExit(f"the {workload} workload has {len(pool)} distinct prompts; asked for {n}")
    return pool[:n]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("spec", __doc__, "concurrency 1,2, 16 tokens")
    add_sizes(ap, DEFAULTS, {"workloads": f"comma list of {', '.join(WORKLOADS)}",
                             "concurrency": "comma list of requests in flight", "output-len": "max tokens per request",
                             "rounds": "A B B A rounds per cell (1: off then on)"})
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default max(4, 2 x concurrency), "
                    "at most 32)")
    ap.add_argument("--spec-args", default="--speculative auto", help="the speculative scheduler's flags, one quoted "
                    "string given with '=' (default '--speculative auto')")
    ap.add_argument("--executor-args", default="", help="extra executor flags, one quoted string given with '='")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.concurrency_list = int_list(args.concurrency, "--concurrency")
    args.workload_list = choices(args.workloads, WORKLOADS, "--workloads")
    if args.output_len < 1 or args.rounds < 1 or (args.requests is not None and args.requests < 1):
        ap.error("--output-len, --rounds and --requests must be >= 1")
    return args


def side_summary(records: list[Record], wall: float) -> dict[str, Any]:
    tokens, ms = sum(len(r.output_ids) for r in records), [r.metrics() for r in records]
    return {"requests": len(records), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_ms": summarize([m["ttft"] for m in ms if m["ttft"] is not None], 1e3),
            "tpot_ms": summarize([m["tpot"] for m in ms if m["tpot"] is not None], 1e3),
            "errors": [r.error for r in records if r.error]}


def measure_repeat(args, urls: dict[str, str], concurrency: int) -> dict[str, Any]:
    """The repeat cell: on each scheduler, the questions asked (A), then asked again (B); B's answers repeat A's,
    which B's prompts do not contain. The figure: B's tokens/s over A's on the speculating side (off's B/A is
    the noise floor)."""
    texts = prompts("repeat", args.requests or min(32, max(4, 2 * concurrency)))
    sides, outputs, counted = {}, {}, dict.fromkeys(COUNTERS, 0.0)
    for mode in ("off", "on"):
        before = openai_client.counters(urls[mode], COUNTERS)
        for ask in ("A", "B"):
            t0 = time.perf_counter()
            recs = asyncio.run(openai_client.run(urls[mode], texts, args.output_len, concurrency, 600.0,
                                                 greedy_exact=False))
            sides[f"{mode} {ask}"] = side_summary(recs, time.perf_counter() - t0)
            outputs[f"{mode} {ask}"] = [r.output_ids for r in recs]
            log(f"repeat c={concurrency} {mode} {ask}: {sides[f'{mode} {ask}']['tokens_per_s']:.1f} tok/s")
        if mode == "on":
            after = openai_client.counters(urls[mode], COUNTERS)
            counted = {k: after[k] - before[k] for k in COUNTERS}
    drafts, drafted, accepted = (counted[k] for k in COUNTERS)
    ref = outputs["off A"]
    return {"workload": "repeat", "concurrency": concurrency, "requests": len(texts),
            "sides": {"off": sides["off B"], "on": sides["on B"]}, "asks": sides,
            "ratio": sides["on B"]["tokens_per_s"] / sides["off B"]["tokens_per_s"],
            "repeat_over_first": sides["on B"]["tokens_per_s"] / sides["on A"]["tokens_per_s"],
            "repeat_over_first_off": sides["off B"]["tokens_per_s"] / sides["off A"]["tokens_per_s"],
            "identical": sum(a == b for k in ("off B", "on A", "on B") for a, b in zip(ref, outputs[k])),
            "compared": 3 * len(texts), "drafts": drafts, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_draft": accepted / drafts if drafts else None}


def measure(args, urls: dict[str, str], workload: str, concurrency: int) -> dict[str, Any]:
    """One (workload, concurrency) cell on both schedulers, A B B A; the ngram side's Prometheus counters around it."""
    if workload == "repeat":
        return measure_repeat(args, urls, concurrency)
    texts = prompts(workload, args.requests or min(32, max(4, 2 * concurrency)))
    walls, records = {"off": 0.0, "on": 0.0}, {"off": [], "on": []}
    delta = dict.fromkeys(COUNTERS, 0.0)
    for mode in [m for r in range(args.rounds) for m in (("off", "on") if r % 2 == 0 else ("on", "off"))]:
        before = openai_client.counters(urls[mode], COUNTERS)
        t0 = time.perf_counter()
        # greedy, up to --output-len tokens, ending at EOS: speculation must not change the output
        recs = asyncio.run(openai_client.run(urls[mode], texts, args.output_len, concurrency, 600.0,
                                             greedy_exact=False))
        walls[mode] += time.perf_counter() - t0
        after = openai_client.counters(urls[mode], COUNTERS)
        if mode == "on":
            delta = {k: delta[k] + after[k] - before[k] for k in COUNTERS}
        records[mode].append(recs)
        log(f"{workload} c={concurrency} {mode}: {sum(len(r.output_ids) for r in recs)} tokens in {walls[mode]:.1f}s")
    sides = {m: side_summary([r for rs in records[m] for r in rs], walls[m]) for m in ("off", "on")}
    identical = sum(a.output_ids == b.output_ids
                    for ra, rb in zip(records["off"], records["on"]) for a, b in zip(ra, rb))
    drafts, drafted, accepted = (delta[k] for k in COUNTERS)
    return {"workload": workload, "concurrency": concurrency, "requests": len(texts), "sides": sides,
            "ratio": sides["on"]["tokens_per_s"] / sides["off"]["tokens_per_s"], "identical": identical,
            "compared": len(texts) * args.rounds, "drafts": drafts, "drafted_tokens": drafted,
            "accepted_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_draft": accepted / drafts if drafts else None,
            "records": {m: [[r.as_json(r.start) for r in rs] for rs in records[m]] for m in records}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = serving_setup(args)
    servers: dict[str, server_process.ServerProcess] = {}
    try:
        servers["executor"] = server_process.launch_executor(
            model_dir, "--threads", str(threads), "--no-prefix-caching", "--kv-blocks", "2048", "--log-level",
            "WARNING", *shlex.split(args.executor_args))
        for mode, flags in (("off", ["--speculative", "off"]), ("on", shlex.split(args.spec_args))):
            servers[mode] = server_process.launch_scheduler(servers["executor"].address, "--http-port", "0",
                                                            "--log-level", "WARNING", *flags)
        urls = {m: servers[m].http_url for m in ("off", "on")}
        for url in urls.values():  # warm-up: first-call costs out of the timed cells
            asyncio.run(openai_client.run(url, prompts("chat", 1), 8, 1, 600.0, greedy_exact=False))
        cells = [measure(args, urls, w, c) for w in args.workload_list for c in args.concurrency_list]
    finally:
        for s in servers.values():
            s.stop()
    print(f"model: {model_dir.name} ({cfg.architecture}), executor {threads} threads, greedy, max {args.output_len} "
          f"new tokens; speculative: {args.spec_args}; rounds {args.rounds}")
    print(table([{"workload": c["workload"], "conc": c["concurrency"], "req": c["requests"],
                  "off tok/s": fmt(c["sides"]["off"]["tokens_per_s"], 1),
                  "on tok/s": fmt(c["sides"]["on"]["tokens_per_s"], 1),
                  "on/off": f"{c['ratio']:.2f}x", "identical": f"{c['identical']}/{c['compared']}",
                  "repeat/first": f"{c['repeat_over_first']:.2f}x (off {c['repeat_over_first_off']:.2f}x)"
                  if "repeat_over_first" in c else "-",
                  "accept": "-" if c["acceptance_rate"] is None else f"{100 * c['acceptance_rate']:.0f}%",
                  "acc/draft": fmt(c["mean_accepted_per_draft"], 2),
                  "TPOT off/on ms": f"{fmt(c['sides']['off']['tpot_ms']['mean'], 1)} / "
                                    f"{fmt(c['sides']['on']['tpot_ms']['mean'], 1)}"} for c in cells]))
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"model": str(model_dir), "threads": threads}
    path = write_json(args.out, {"benchmark": "bench_spec", "config": config, "machine": machine_info("cpu"),
                                 "model": model_json(model_dir, cfg), "cells": cells})
    log(f"wrote {path}")
    errors = [e for c in cells for side in c["sides"].values() for e in side["errors"]]
    if errors:
        log(f"{len(errors)} requests failed; first: {errors[0]}")
    return 1 if errors else 0
