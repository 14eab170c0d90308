"""PNG charts of benchmark results.

matplotlib is imported only here and only when a chart is asked for, so the benchmark runs
without it. Figures are drawn on ``matplotlib.figure.Figure`` directly, rendered by the Agg
(raster, headless) backend, never through ``pyplot``: no display is needed and a caller's
own pyplot state and backend choice are left alone.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def require_matplotlib() -> None:
    """Raise ``ImportError`` with an install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'matplotlib>=3.7'") from None


def _figure(rows: int, cols: int, width: float, height: float) -> Any:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_latency_distributions(per_request: dict[str, Any], path: str, title: str = "") -> str:
    """Histograms with their CDFs of TTFT, TPOT, ITL and E2E latency (ms) for one run.

    ``per_request`` is the ``"requests"`` part of a saved result: lists ``ttft_ms``,
    ``tpot_ms``, ``e2el_ms`` (``None`` where undefined) and ``itl_ms`` (a list per request).
    """
    series = {
        "TTFT (ms)": per_request.get("ttft_ms", []),
        "TPOT (ms)": per_request.get("tpot_ms", []),
        "ITL (ms)": [x for r in per_request.get("itl_ms", []) for x in (r or [])],
        "E2E latency (ms)": per_request.get("e2el_ms", []),
    }
    fig = _figure(2, 2, 11, 7.5)
    axes = fig.subplots(2, 2).ravel()
    for ax, (name, values) in zip(axes, series.items()):
        v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
        ax.set_xlabel(name)
        if v.size == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        ax.hist(v, bins=min(50, max(5, int(math.sqrt(v.size)) * 2)), color="tab:blue", alpha=0.6)
        ax.set_ylabel("count")
        cdf = ax.twinx()
        xs = np.sort(v)
        cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, color="tab:orange", lw=1.5)
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("CDF")
        for q, style in ((50, "--"), (99, ":")):
            x = float(np.percentile(v, q))
            ax.axvline(x, color="black", ls=style, lw=1, label=f"p{q} = {x:.1f}")
        ax.legend(loc="center right", fontsize=8)
    fig.suptitle(title or "Latency distributions")
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_concurrency_sweep(points: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """Throughput and latency against concurrency for a ``--concurrency-sweep``.

    Each point is ``{"max_concurrency": int, "metrics": BenchmarkMetrics.to_dict()}``.
    """
    pts = sorted(points, key=lambda p: p["max_concurrency"])
    x = [p["max_concurrency"] for p in pts]
    m = [p["metrics"] for p in pts]
    fig = _figure(2, 2, 11, 7.5)
    (ax_tp, ax_ttft), (ax_tpot, ax_e2e) = fig.subplots(2, 2)
    ax_tp.plot(x, [d["output_token_throughput"] for d in m], "o-", label="output tok/s")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("Output token throughput")
    for ax, key, name in ((ax_ttft, "ttft_ms", "TTFT"), (ax_tpot, "tpot_ms", "TPOT"),
                          (ax_e2e, "e2el_ms", "E2E latency")):
        ax.plot(x, [d[key]["median"] for d in m], "o-", label="median")
        ax.plot(x, [d[key]["p99"] for d in m], "s--", label="p99")
        ax.set_ylabel("ms")
        ax.set_title(name)
        ax.legend(fontsize=8)
    for ax in (ax_tp, ax_ttft, ax_tpot, ax_e2e):
        ax.set_xlabel("max concurrency")
        if len(x) > 1 and x[-1] / max(x[0], 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "Concurrency sweep")
    fig.savefig(path, format="png", dpi=100)
    return path
