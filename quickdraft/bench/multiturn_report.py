"""`quickdraft bench multiturn`'s numbers: per target, TTFT per turn (median over sessions and
rounds), prompt and cached tokens per turn, total throughput, the first turn of session 1 against
the others'; and the ratios of the first target (quickdraft with its prefix cache) to each other
one, all from records measured in the same run. With replicas: the share of the prompt cached from
turn 4 on, the sessions that stayed on one replica, and each replica's load. Markdown tables, the
JSON object and the chart.

Knows records (multiturn.TurnRecord as dicts) and numbers, not servers.
"""
from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Any, Sequence

from quickdraft.cluster.load import load_table

LATE_TURN = 4  # issue 30's goals compare TTFT "from turn 4 on"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sum_or_none(values: Sequence[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(values)


def per_turn(records: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per turn index: TTFT median and mean over sessions, mean prompt and cached tokens, and
    the share of prompt tokens that were cached (None where the server reports no cached tokens)."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == turn]
        prompt, cached = sum(r["prompt_tokens"] for r in rs), _sum_or_none([r["cached_tokens"] for r in rs])
        rows.append({"turn": turn, "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
                     "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rs),
                     "prompt_tokens_mean": prompt / len(rs),
                     "cached_tokens_mean": None if cached is None else cached / len(rs),
                     "cached_fraction": None if cached is None or not prompt else cached / prompt})
    return rows


def first_turns(records: Sequence[dict]) -> dict[str, float | None]:
    """Turn 1's TTFT of session 1 and of the others, medians over rounds (and sessions): a shared
    system prompt read by session 1 first is what the others may find cached."""
    lead = [r["ttft_s"] for r in records if r["turn"] == 1 and r["session"] == 1]
    others = [r["ttft_s"] for r in records if r["turn"] == 1 and r["session"] != 1]
    lead_s = statistics.median(lead) if lead else None
    median = statistics.median(others) if others else None
    return {"session1_ttft_s": lead_s, "others_median_ttft_s": median,
            "others_over_session1": median / lead_s if median is not None and lead_s else None}


def cached_late_fraction(records: Sequence[dict]) -> float | None:
    """Cached / prompt tokens over the turns from LATE_TURN on (None where not reported)."""
    late = [r for r in records if r["turn"] >= LATE_TURN]
    prompt, cached = sum(r["prompt_tokens"] for r in late), _sum_or_none([r["cached_tokens"] for r in late])
    return None if cached is None or not prompt else cached / prompt


def sessions_on_one_replica(records: Sequence[dict]) -> list[int] | None:
    """[sessions whose every turn one replica answered, sessions], over rounds; None where no answer
    named its replica (one process, llama-server)."""
    replicas: dict[tuple[int, int], set[str | None]] = {}
    for r in records:
        replicas.setdefault((r.get("round", 1), r["session"]), set()).add(r.get("replica"))
    if all(names == {None} for names in replicas.values()):
        return None
    return [sum(len(names) == 1 and None not in names for names in replicas.values()), len(replicas)]


def summarize(rounds: Sequence[dict]) -> dict[str, Any]:
    """One target over its rounds ({"wall_s", "records"} each): TTFT and tokens over every record,
    wall time and output tokens/s as medians over rounds."""
    records = [r for run in rounds for r in run["records"]]
    late = [r["ttft_s"] for r in records if r["turn"] >= LATE_TURN]
    completion = sum(r["completion_tokens"] for r in records)
    loads = [run["load_1min"] for run in rounds if run.get("load_1min") is not None]
    peaks = [run["kv_peak_mib"] for run in rounds if run.get("kv_peak_mib") is not None]
    return {"rounds": len(rounds), "wall_s": statistics.median(run["wall_s"] for run in rounds),
            "walls_s": [run["wall_s"] for run in rounds], "load_1min_max": max(loads) if loads else None,
            "kv_peak_mib": max(peaks) if peaks else None,
            "requests": len(records), "completion_tokens": completion,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "cached_tokens": _sum_or_none([r["cached_tokens"] for r in records]),
            "output_tokens_per_s": statistics.median(sum(r["completion_tokens"] for r in run["records"]) / run["wall_s"]
                                                     for run in rounds),
            "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in records),
            "ttft_late_median_s": statistics.median(late) if late else None,
            "cached_late_fraction": cached_late_fraction(records),
            "sessions_on_one_replica": sessions_on_one_replica(records),
            "per_turn": per_turn(records), "first_turn": first_turns(records)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """base / other: TTFT per turn (medians), from LATE_TURN on, mean; output tokens/s."""
    other_turns = {row["turn"]: row for row in other["per_turn"]}
    return {"ttft_per_turn": {row["turn"]: _ratio(row["ttft_median_s"], other_turns[row["turn"]]["ttft_median_s"])
                              for row in base["per_turn"] if row["turn"] in other_turns},
            "ttft_late_median": _ratio(base["ttft_late_median_s"], other["ttft_late_median_s"]),
            "ttft_mean": _ratio(base["ttft_mean_s"], other["ttft_mean_s"]),
            "output_tokens_per_s": _ratio(base["output_tokens_per_s"], other["output_tokens_per_s"])}


def build_results(config: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`runs`: target name -> {"rounds": [{"wall_s", "records"}, ...], ...}, the base target first."""
    summaries = {name: summarize(run["rounds"]) for name, run in runs.items()}
    base = next(iter(summaries))
    return {"config": config, "base": base, "summary": summaries,
            "ratios": {name: ratios(summaries[base], s) for name, s in summaries.items() if name != base},
            "runs": runs}


def _s(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _tokens(row: dict[str, Any]) -> str:
    cached = "-" if row["cached_tokens_mean"] is None else f"{row['cached_tokens_mean']:,.0f}"
    return f"{row['prompt_tokens_mean']:,.0f} ({cached})"


def markdown_report(results: dict[str, Any]) -> str:
    c, summary, base = results["config"], results["summary"], results["base"]
    names, others = list(summary), [n for n in summary if n != base]
    turns = [row["turn"] for row in summary[base]["per_turn"]]
    rows = {n: {row["turn"]: row for row in s["per_turn"]} for n, s in summary.items()}
    out = [f"`{c['command']}`", "",
           f"{c['model']}, {c['sessions']} sessions x {c['turns']} turns, {c['max_tokens']} tokens per answer, "
           f"{c['threads']} threads, {c['rounds']} round(s), CPU: {c['cpu']}, {c['date']}", "",
           "TTFT per turn, median over sessions and rounds (s), and " + base + "'s ratio to each other target:", "",
           "| turn | " + " | ".join(names) + "".join(f" | {base} / {n}" for n in others) + " |",
           "|---:|" + "---:|" * (len(names) + len(others))]
    for t in turns:
        cells = [_s(rows[n].get(t, {}).get("ttft_median_s")) for n in names]
        cells += [_x(results["ratios"][n]["ttft_per_turn"].get(t)) for n in others]
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    out += ["", "Prompt tokens per turn, mean over sessions and rounds (cached tokens in brackets; - where not "
                "reported):",
            "", "| turn | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    out += [f"| {t} | " + " | ".join(_tokens(rows[n][t]) if t in rows[n] else "-" for n in names) + " |"
            for t in turns]
    out += ["", f"| target | wall per round (s) | output tokens/s, median | TTFT mean (s) | "
                f"TTFT median, turn >= {LATE_TURN} (s) | turn 1: session 1 (s) | turn 1: sessions 2+, median (s) | "
                "machine load, 1 min, max | K/V held at most (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, s in summary.items():
        f = s["first_turn"]
        walls = ", ".join(f"{w:.1f}" for w in s["walls_s"])
        out.append(f"| {n} | {walls} | {s['output_tokens_per_s']:.1f} | {_s(s['ttft_mean_s'])} | "
                   f"{_s(s['ttft_late_median_s'])} | {_s(f['session1_ttft_s'])} | {_s(f['others_median_ttft_s'])} | "
                   f"{_s(s['load_1min_max'], 1)} | {_s(s['kv_peak_mib'], 0)} |")
    out.append("")
    for n in others:
        r = results["ratios"][n]
        out.append(f"- {base} / {n}: TTFT from turn {LATE_TURN} on {_x(r['ttft_late_median'])}, mean TTFT "
                   f"{_x(r['ttft_mean'])}, output tokens/s {_x(r['output_tokens_per_s'])}")
    f = summary[base]["first_turn"]
    if f["others_over_session1"] is not None:
        out.append(f"- {base}, turn 1: sessions 2+ / session 1 {_x(f['others_over_session1'])}")
    return "\n".join(out + _replica_lines(results)) + "\n"


def _replica_lines(results: dict[str, Any]) -> list[str]:
    """With replicas: per target, the prompt cached from LATE_TURN on, the sessions that stayed on one
    replica, and each round's per-replica load."""
    if all(s["sessions_on_one_replica"] is None for s in results["summary"].values()):
        return []
    out = ["", f"| target | prompt cached from turn {LATE_TURN} on | sessions on one replica |", "|---|---:|---:|"]
    for n, s in results["summary"].items():
        cached = "-" if s["cached_late_fraction"] is None else f"{s['cached_late_fraction']:.1%}"
        one = s["sessions_on_one_replica"]
        out.append(f"| {n} | {cached} | {'-' if one is None else f'{one[0]} of {one[1]}'} |")
    for n, run in results["runs"].items():
        for i, r in enumerate(run["rounds"], 1):
            if r.get("replica_load"):
                out += ["", f"{n}, round {i}, per replica:", "", load_table(r["replica_load"]).rstrip("\n")]
    return out


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    """multiturn.json, multiturn.md and ttft.png (TTFT per turn, one line per target) in `out`."""
    from quickdraft.bench.plot import plot_ttft_per_turn
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "multiturn.json", out / "multiturn.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown_report(results))
    series = {n: {row["turn"]: row["ttft_median_s"] for row in s["per_turn"]} for n, s in results["summary"].items()}
    c = results["config"]
    title = (f"{c['model']}: {c['sessions']} sessions x {c['turns']} turns, {c['threads']} threads\n{c['cpu']}")
    paths.append(plot_ttft_per_turn(series, title, out / "ttft.png"))
    return paths
