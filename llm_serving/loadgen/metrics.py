"""Run summary with vLLM's benchmark definitions.

- duration: wall time from the first send to the last response;
- completed / failed requests; request throughput = completed / duration;
- output throughput = output tokens of completed requests / duration; total token throughput adds
  their prompt tokens;
- TTFT: send -> first token; TPOT: (E2EL - TTFT) / (output tokens - 1), per request with >= 2 tokens;
  ITL: every gap between successive token chunks, pooled over requests; E2EL: send -> end of stream;
  each reported as mean, std, median and the asked percentiles, in milliseconds;
- goodput: completed requests meeting every given SLO (TTFT, TPOT, E2EL in ms) per second.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .backends import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slos(items: Optional[list]) -> dict:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
    return slos


def _stats(values_s: list, percentiles: list) -> dict:
    if not values_s:
        return {"mean": None, "std": None, "median": None, **{f"p{p:g}": None for p in percentiles}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "std": float(ms.std()), "median": float(np.median(ms))}
    out.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize(results: list, duration_s: float, percentiles=(90, 99), slos: Optional[dict] = None) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    duration_s = max(duration_s, 1e-9)
    summary = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": _stats([r.ttft for r in ok], list(percentiles)),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None], list(percentiles)),
        "itl_ms": _stats([g for r in ok for g in r.itl], list(percentiles)),
        "e2el_ms": _stats([r.latency for r in ok], list(percentiles)),
    }
    if slos:
        good = [r for r in ok if _meets(r, slos)]
        summary["goodput"] = {"slos_ms": slos, "good_requests": len(good), "request_goodput": len(good) / duration_s}
    errors: dict = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    summary["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    return summary


def _meets(r: RequestResult, slos: dict) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for key, limit in slos.items():
        v = values[key]
        if v is not None and v * 1000.0 > limit:
            return False
    return True


def format_table(summary: dict, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label, value, fmt="{:.2f}"):
        text = "n/a" if value is None else (fmt.format(value) if not isinstance(value, str) else value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", summary["completed"], "{:d}")
    row("Failed requests:", summary["failed"], "{:d}")
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"], "{:d}")
    row("Total generated tokens:", summary["total_output_tokens"], "{:d}")
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if "goodput" in summary:
        row("Request goodput (req/s):", summary["goodput"]["request_goodput"])
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{' ' + name + ' ':-^60}")
        short = key.split("_")[0].upper()
        for stat, value in summary[key].items():
            if stat == "std":
                continue
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            row(f"{label} {short} (ms):", value)
    for error, count in summary.get("errors", {}).items():
        lines.append(f"failed x{count}: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)
