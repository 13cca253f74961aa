"""The quantized benchmark's numbers and tables: a file's facts (size, weight bytes one token reads), a serving side's
summary, the ratios against llama.cpp with their targets, the memory target, and the stdout tables. Pure (no
servers), so that tests/benchmarks/test_quantized_report.py checks it on made-up results."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import format_table

GIB = float(1 << 30)
# measure -> (Tandem / llama.cpp target, "higher" or "lower" is better): issue 43's bar for the quantized path
TARGETS = {"decode": (1.2, "higher"), "prefill": (1.0, "higher"), "serving_tok_s": (1.3, "higher"),
           "serving_ttft": (1.0, "lower")}
MEMORY_TARGET = (1.15, 0.5 * GIB)  # RSS after READY <= 1.15 x file size + 0.5 GiB


def file_facts(path: Path) -> dict[str, Any]:
    """Size, parameter count and the weight bytes a decode step reads of a GGUF file: every tensor's stored bytes
    (a tied embedding table is read whole as the LM head; an untied one is read one row per token)."""
    import gguf
    reader = gguf.GGUFReader(path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    read = sum(int(t.n_bytes) for t in reader.tensors if tied or t.name != "token_embd.weight")
    return {"file": path.name, "path": str(path), "file_bytes": path.stat().st_size,
            "params": sum(int(t.n_elements) for t in reader.tensors), "bytes_per_token": read}


def serving_side(name: str, records: list[Any], output_len: int) -> dict[str, Any]:
    """The request_metrics aggregate of one side, with the figures the table shows on top. Output tokens are the
    servers' usage counts (llama-server never streams the id of a token that ends inside a UTF-8 character), else
    the streamed ones; `exact`: requests that ended at the length limit with output_len tokens counted."""
    from benchmarks.request_metrics import aggregate
    agg = aggregate(name, records, output_len=output_len)
    errors = [r.error for r in records if r.error]
    done = [r for r in records if r.error is None]
    counts = [(r.usage or {}).get("completion_tokens", r.output_len) for r in done]
    tok_s = sum(counts) / agg["duration_s"] if agg["duration_s"] else None
    exact = sum(n == output_len and r.finish_reason == "length" for r, n in zip(done, counts))
    return {"output_tok_s": tok_s, "streamed_output_tok_s": agg["output_throughput"],
            "ttft_p50_ms": agg["ttft_ms"]["p50"], "tpot_p50_ms": agg["tpot_ms"]["p50"], "exact": exact,
            "requests": len(records), "failed": agg["failed"], "first_error": errors[0] if errors else None,
            "aggregate": agg}


def side_text(side: dict[str, Any]) -> str:
    """'12.3 out tok/s, TTFT p50 456 ms, 0 failed' ('-' for what was not measured): a log line's figures."""
    def num(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"
    return (f"{num(side.get('output_tok_s'), 1)} out tok/s, TTFT p50 {num(side.get('ttft_p50_ms'), 0)} ms, "
            f"{side.get('failed', '-')} failed")


def serving_comparison(tandem: dict[str, Any], llama: dict[str, Any], tandem_records: list[Any],
                       llama_records: list[Any]) -> dict[str, Any]:
    """The ratios (Tandem / llama.cpp) of the two sides' summaries, and how many requests generated the same
    greedy tokens on both (the same file, greedy: they should, up to near-ties the kernels' rounding flips)."""
    from benchmarks.request_metrics import agreement
    return {"ratios": {"output_tok_s": ratio(tandem.get("output_tok_s"), llama.get("output_tok_s")),
                       "ttft_p50": ratio(tandem.get("ttft_p50_ms"), llama.get("ttft_p50_ms"))},
            "agreement": agreement(tandem_records, llama_records)}


def ratio(tandem: float | None, llama: float | None) -> float | None:
    return tandem / llama if tandem and llama else None


def verdict(value: float | None, target: tuple[float, str]) -> str:
    """'ok' / 'below' / 'above' against a (bar, better) target; '-' when unmeasured."""
    if value is None:
        return "-"
    bar, better = target
    good = value >= bar if better == "higher" else value <= bar
    return "ok" if good else ("below" if better == "higher" else "above")


def memory_check(rss: int | None, file_bytes: int) -> dict[str, Any]:
    if rss is None:
        return {"rss_over_file": None, "memory_budget": None, "memory_ok": None}
    budget = MEMORY_TARGET[0] * file_bytes + MEMORY_TARGET[1]
    return {"rss_over_file": rss / file_bytes, "memory_budget": budget, "memory_ok": rss <= budget}


def speed_rows(files: list[dict[str, Any]], bandwidth: float) -> list[dict[str, Any]]:
    """One row per file x type: decode, prefill and memory, each side, ratios, and the bandwidth bound of a decode
    step that reads the file's weight bytes once (bandwidth: bytes/s)."""
    rows = []
    for f in files:
        t, ll = f.get("tandem") or {}, f.get("llama") or {}
        mem = memory_check((t.get("memory") or {}).get("rss"), f["file_bytes"])
        dec, pre = ratio(t.get("decode_tok_s"), ll.get("decode_tok_s")), ratio(t.get("prefill_tok_s"),
                                                                               ll.get("prefill_tok_s"))
        bound = bandwidth / f["bytes_per_token"]
        rows.append({"shape": f["shape"], "type": f["type"], "file GiB": f["file_bytes"] / GIB,
                     "decode T": t.get("decode_tok_s"), "decode L": ll.get("decode_tok_s"), "decode T/L": dec,
                     "decode ok": verdict(dec, TARGETS["decode"]),
                     "BW bound": bound, "T/bound": ratio(t.get("decode_tok_s"), bound),
                     "L/bound": ratio(ll.get("decode_tok_s"), bound),
                     "pp T": t.get("prefill_tok_s"), "pp L": ll.get("prefill_tok_s"), "pp T/L": pre,
                     "pp ok": verdict(pre, TARGETS["prefill"]),
                     "RSS GiB": None if mem["rss_over_file"] is None else mem["rss_over_file"] * f["file_bytes"] / GIB,
                     "RSS/file": mem["rss_over_file"],
                     "mem ok": "-" if mem["memory_ok"] is None else ("ok" if mem["memory_ok"] else "above")})
    return rows


def serving_rows(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for f in files:
        s = f.get("serving")
        if not s:
            continue
        t, ll = s.get("tandem") or {}, s.get("llama") or {}
        tok, ttft = ratio(t.get("output_tok_s"), ll.get("output_tok_s")), ratio(t.get("ttft_p50_ms"),
                                                                                ll.get("ttft_p50_ms"))
        same = s.get("agreement") or {}
        rows.append({"shape": f["shape"], "type": f["type"], "out tok/s T": t.get("output_tok_s"),
                     "out tok/s L": ll.get("output_tok_s"), "tok/s T/L": tok,
                     "tok/s ok": verdict(tok, TARGETS["serving_tok_s"]), "TTFT p50 T": t.get("ttft_p50_ms"),
                     "TTFT p50 L": ll.get("ttft_p50_ms"), "TTFT T/L": ttft,
                     "TTFT ok": verdict(ttft, TARGETS["serving_ttft"]),
                     "TPOT p50 T": t.get("tpot_p50_ms"), "TPOT p50 L": ll.get("tpot_p50_ms"),
                     "exact T/L": f"{t.get('exact', '-')}/{ll.get('exact', '-')}",
                     "failed T/L": f"{t.get('failed', '-')}/{ll.get('failed', '-')}",
                     "same tokens": f"{same['identical']}/{same['compared']}" if same else "-"})
    return rows


def cpu_flags() -> str:
    """'AVX2, AVX-512' (what of them /proc/cpuinfo lists), for the header."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "?"
    found = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "AVX512-VNNI"),
                                     ("avx_vnni", "AVX-VNNI")) if flag in flags]
    return ", ".join(found) or "no AVX2"


def print_tables(args: Any, results: dict[str, Any], machine: dict[str, Any], threads: int) -> None:
    bw = results["bandwidth"]
    print(f"CPU: {machine.get('processor')} ({cpu_flags()}), {threads} threads; memory bandwidth (torch, 1 GiB): "
          f"read {bw['read'] / 1e9:.1f} GB/s, copy {bw['copy'] / 1e9:.1f} GB/s; load average at the start "
          f"{machine.get('load_average') or 0:.1f} (other jobs then: their load disturbs the timings)")
    files = results["files"]
    rows = speed_rows(files, bw["read"])
    if rows and any(k in args.part_list for k in ("decode", "prefill", "memory")):
        print(f"\nper file (T = Tandem, L = llama.cpp): decode tok/s at batch 1 ({args.gen} tokens; llama-bench "
              f"-p 0 -n {args.gen}), pp = {args.prompt_len}-token prompt tok/s (llama-bench -p {args.prompt_len} "
              f"-n 0), medians of {args.repeats}; BW bound = read bandwidth / the file's weight bytes per token (decode "
              f"tok/s if reading weights were all a token cost; T/bound, L/bound: each side's share of it); "
              f"RSS = executor after READY")
        print(format_table(rows, [(k, k, 2) for k in rows[0]]))
        print(f"targets: decode T/L >= {TARGETS['decode'][0]}, pp T/L >= {TARGETS['prefill'][0]}, RSS <= "
              f"{MEMORY_TARGET[0]} x file + {MEMORY_TARGET[1] / GIB:.1f} GiB")
    srows = serving_rows(files)
    if srows:
        print(f"\n{args.streams} concurrent streams, {args.requests} requests x ({args.input_len} prompt, "
              f"{args.output_len} output tokens), closed loop, greedy, {threads} threads each; Tandem's OpenAI "
              f"front vs llama-server --parallel {args.streams} -c {args.streams}x(prompt+output) (its /completion "
              f"route); ms; exact: requests of exactly {args.output_len} tokens; same tokens: requests whose "
              f"greedy tokens were the same on both sides")
        print(format_table(srows, [(k, k, 1) for k in srows[0]]))
        print(f"targets: output tok/s T/L >= {TARGETS['serving_tok_s'][0]}, TTFT p50 T/L <= "
              f"{TARGETS['serving_ttft'][0]}")
    q = results.get("quality")
    if q:
        print(f"\nquality: {q['file']} in Tandem vs transformers on its dequantized weights: teacher-forced logits "
              f"over {q['positions']} positions: max |diff| {q['max_abs_diff']:.4g}, top-1 agreement "
              f"{q['top1_agree']}/{q['positions']}; greedy tokens over {len(q['greedy_equal'])} chat prompts: "
              f"{sum(q['greedy_equal'])}/{q['greedy_total']} equal (leading, per prompt {q['greedy_equal']})")
