"""PNG plots of a run: latency CDFs, and output throughput and running requests over time."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def timeline(results: list, duration_s: float, bin_s: float = 1.0) -> dict:
    """Output tokens/s and requests in flight per time bin (pure; the plot draws it)."""
    n_bins = max(1, int(np.ceil(duration_s / bin_s)))
    edges = np.arange(n_bins + 1) * bin_s
    times = np.asarray([t for r in results if r.ok for t in r.token_times], dtype=np.float64)
    tokens = np.histogram(times, bins=edges)[0] / bin_s if times.size else np.zeros(n_bins)
    mid = edges[:-1] + bin_s / 2
    running = np.zeros(n_bins, dtype=np.int64)
    for r in results:
        end = r.send_time + (r.latency if r.latency is not None else 0.0)
        running += (r.send_time <= mid) & (mid < end)
    return {"t_s": mid.tolist(), "output_tok_s": tokens.tolist(), "running": running.tolist()}


def write_plots(results: list, duration_s: float, stem: Path) -> list:
    """Write `<stem>_latency_cdf.png` and `<stem>_timeline.png`; returns the paths (empty without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [g for r in ok for g in r.itl], "E2EL": [r.latency for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items()):
        if values:
            ms = np.sort(np.asarray(values) * 1000.0)
            ax.plot(ms, np.arange(1, ms.size + 1) / ms.size)
        ax.set_title(f"{name} CDF ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = stem.parent / (stem.name + "_latency_cdf.png")
    fig.savefig(cdf, dpi=90)
    plt.close(fig)

    tl = timeline(results, duration_s)
    fig, ax1 = plt.subplots(figsize=(10, 4))
    ax1.plot(tl["t_s"], tl["output_tok_s"], color="tab:blue", label="output tokens/s")
    ax1.set_xlabel("time since start (s)")
    ax1.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(tl["t_s"], tl["running"], where="mid", color="tab:orange", label="requests in flight")
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    over_time = stem.parent / (stem.name + "_timeline.png")
    fig.savefig(over_time, dpi=90)
    plt.close(fig)
    return [str(cdf), str(over_time)]
