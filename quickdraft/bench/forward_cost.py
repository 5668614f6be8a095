"""`quickdraft bench forward-cost`: the t(q)/t(1) curve of a model on a device, as a table,
and with an output folder as forward_cost.json and forward_cost.png.

The measuring itself is quickdraft.engine.cost (reusable by an adaptive k); this module only
loads, prints and writes files.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from quickdraft.api import load
from quickdraft.engine.cost import ForwardCost, measure_forward_cost

DEFAULT_Q = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def default_q_values(max_q: int) -> list[int]:
    """A spread of q up to max_q (max_q itself included)."""
    return sorted({q for q in DEFAULT_Q if q <= max_q} | {max_q})


def cost_table(cost: ForwardCost) -> str:
    """One row per q; the LM head's columns say what verification that scored only the positions up to
    the first rejection could save: head(q) - head(m) when m of the q positions decide (docs/benchmarks.md)."""
    lines = ["| q | t(q) ms | t(q)/t(1) | per token vs q=1 | LM head ms | head(q)/t(1) | head share |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for q, ratio in sorted(cost.ratios.items()):
        head = cost.head_s[q]
        lines.append(f"| {q} | {cost.median_s[q] * 1000:.2f} | {ratio:.2f} | {ratio / q:.3f} | {head * 1000:.2f} | "
                     f"{head / cost.t1_s:.3f} | {head / cost.median_s[q]:.0%} |")
    return "\n".join(lines)


def run_forward_cost(model: str, device: str, dtype: str, q_values: list[int], context_len: int,
                     repeats: int, out: Path | None = None) -> ForwardCost:
    llm = load(model, device=device, dtype=dtype)
    cost = measure_forward_cost(llm.model, q_values, context_len=context_len, repeats=repeats)
    title = (f"{llm.loaded.source.path.name} | {device} {dtype} | context {context_len} | "
             f"median of {repeats} | {torch.get_num_threads()} threads")
    print(f"forward cost: {title}")
    print(cost_table(cost))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "model": str(model), "model_file": str(llm.loaded.source.path), "device": device, "dtype": dtype,
            "context_len": context_len, "repeats": repeats, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
            "t1_s": cost.t1_s,
            "ratios": {str(q): r for q, r in sorted(cost.ratios.items())},
            "median_s": {str(q): s for q, s in sorted(cost.median_s.items())},
            "head_s": {str(q): s for q, s in sorted(cost.head_s.items())},
        }
        (out / "forward_cost.json").write_text(json.dumps(record, indent=2) + "\n")
        from quickdraft.bench.plot import plot_forward_cost
        plot_forward_cost(cost.ratios, title, out / "forward_cost.png")
        print(f"wrote {out / 'forward_cost.json'} and {out / 'forward_cost.png'}")
    return cost
