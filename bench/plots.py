"""PNG figures for ``bench serve`` / ``bench compare`` (and simulated runs): latency CDFs,
throughput over time and queue depth over time. Each figure overlays one line per run, so the
comparison mode shows its systems side by side."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from pdserve.bench.metrics import RequestRecord, throughput_series

FIGURES = ("latency_cdf.png", "throughput.png", "queue_depth.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _cdf(ax, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = sorted(max(v, 1e-2) for v in values)  # log axis: clamp exact zeros
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("TTFT (ms)", lambda rs: [r.ttft_ms for r in rs]),
              ("TPOT (ms)", lambda rs: [t for t in (r.tpot_ms for r in rs) if t is not None]),
              ("ITL (ms)", lambda rs: [x for r in rs for x in r.itls_ms()]),
              ("end-to-end latency (ms)", lambda rs: [r.e2e_ms for r in rs])]
    for ax, (name, pick) in zip(axes.flat, panels):
        for label, records in runs.items():
            _cdf(ax, pick([r for r in records if r.ok]), label)
        ax.set_xlabel(name + ", log scale")
        ax.set_xscale("log")
        ax.set_ylabel("fraction of requests" if "ITL" not in name else "fraction of tokens")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
        _legend(ax, fontsize=8)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(runs: Mapping[str, Sequence[RequestRecord]], path: Path, bin_s: float = 1.0,
                    title: str = "") -> Path:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for label, records in runs.items():
        s = throughput_series(records, bin_s)
        ax1.plot(s["t"], s["output_tokens_per_s"], label=label, drawstyle="steps-post")
        ax2.plot(s["t"], s["requests_per_s"], label=label, drawstyle="steps-post")
    ax1.set_ylabel(f"output tokens/s ({bin_s:g} s bins)")
    ax2.set_ylabel("completed requests/s")
    ax2.set_xlabel("time since the first request (s)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    fig.suptitle(title or "throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_queue_depth(runs: Mapping[str, Sequence[Mapping]], path: Path, title: str = "") -> Path:
    """``runs``: label -> status samples ``{"t", "router_queue", "in_flight", "workers":
    {worker id: {"active", "queue"}}}``."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for label, samples in runs.items():
        t = [s["t"] for s in samples]
        ax1.plot(t, [s["router_queue"] for s in samples], label=f"{label}: router queue", drawstyle="steps-post")
        ax1.plot(t, [s["in_flight"] for s in samples], label=f"{label}: in flight", drawstyle="steps-post",
                 linestyle="--")
        worker_ids = sorted({w for s in samples for w in s.get("workers", {})})
        for w in worker_ids:
            ax2.plot(t, [s.get("workers", {}).get(w, {}).get("active", 0)
                         + s.get("workers", {}).get(w, {}).get("queue", 0) for s in samples],
                     label=f"{label}: {w}", drawstyle="steps-post")
    ax1.set_ylabel("requests")
    ax2.set_ylabel("requests on the worker (active + queued)")
    ax2.set_xlabel("time since the first request (s)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    fig.suptitle(title or "queue depth over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(out_dir: Path, records: Mapping[str, Sequence[RequestRecord]],
                  samples: Mapping[str, Sequence[Mapping]], title: str = "") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_cdfs(records, out_dir / FIGURES[0], f"{title}: latency CDFs" if title else ""),
        plot_throughput(records, out_dir / FIGURES[1], title=f"{title}: throughput" if title else ""),
        plot_queue_depth(samples, out_dir / FIGURES[2], f"{title}: queue depth" if title else ""),
    ]
