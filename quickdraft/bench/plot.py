"""PNG charts for the benchmarks (matplotlib, Agg backend: no display needed).

Knows figures and file names only; the numbers arrive ready-made.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from quickdraft.extras import require


def _pyplot():
    require("bench", "matplotlib", needed_for="the benchmark's charts")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_forward_cost(ratios: Mapping[int, float], title: str, path: Path) -> Path:
    """t(q)/t(1) against q, with the memory-bound ideal (flat at 1) and the compute-bound line (q)."""
    plt = _pyplot()
    qs = sorted(ratios)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(qs, [ratios[q] for q in qs], marker="o", label="measured t(q)/t(1)")
    ax.plot(qs, [1.0] * len(qs), linestyle="--", color="grey", label="memory-bound ideal (1)")
    ax.plot(qs, [float(q) for q in qs], linestyle=":", color="grey", label="q separate passes (q)")
    ax.set_ylim(0, max(2.0, max(ratios.values()) * 1.15))
    ax.set_xlabel("q: tokens fed per forward pass (k drafts + 1)")
    ax.set_ylabel("t(q) / t(1)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_speedup(speedups: Mapping[str, Mapping[str, float]], columns: Sequence[str], title: str,
                 path: Path) -> Path:
    """Grouped bars: one group of bars per column (task group, then 'overall'), one bar per
    method (speedups[method][column]); plain decoding is the dashed line at 1."""
    plt = _pyplot()
    methods = list(speedups)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(columns) * max(1, len(methods)) ** 0.5), 4.5))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(columns))]
        values = [speedups[method].get(col, 0.0) or 0.0 for col in columns]
        bars = ax.bar(xs, values, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, linestyle="--", color="grey", linewidth=1, label="plain (1.00)")
    ax.set_xticks(range(len(columns)), columns, rotation=20)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ttft_per_turn(series: Mapping[str, Mapping[int, float]], title: str, path: Path) -> Path:
    """Time to first token against the turn of a conversation, one line per server (series[name][turn])."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_turn in series.items():
        turns = sorted(by_turn)
        ax.plot(turns, [by_turn[t] for t in turns], marker="o", label=name)
    ax.set_xlabel("turn (the whole history resent)")
    ax.set_ylabel("time to first token, median over sessions and rounds (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
