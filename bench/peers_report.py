"""The numbers of `bench_peers.py`: medians over rounds, the peers table, ratios, the issue's targets,
and the results files (JSON and Markdown) with the machine's description.

A run's raw results: {point: [one dict per round: {target: the load generator's result}]}, the points
being POINTS and the targets TARGETS (`direct` is the stub itself, the baseline of every "added").
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: point -> (streamed, clients)
POINTS = {"non-stream c=1": (False, 1), "stream c=1": (True, 1),
          "non-stream c=32": (False, 32), "stream c=32": (True, 32)}
#: target -> the row's name in the table
TARGETS = {"direct": "direct (the stub)", "litellm": "LiteLLM (one process)",
           "plain": "plain proxy (Starlette + httpx)", "admin": "ours, admin key",
           "governed": "ours, virtual key (budget + RPM + TPM)"}
ROWS = ("litellm", "plain", "admin", "governed")
NAN = float("nan")

Rounds = list[dict[str, dict[str, Any]]]


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else NAN


def _each(rounds: Rounds, target: str, field: str, minus_direct: bool) -> list[float]:
    """`field` of `target` in every round that measured it (less the same round's direct)."""
    out = []
    for r in rounds:
        res = r.get(target)
        if res is None or not res.get("count"):
            continue
        value = res.get(field)
        if value is None:
            continue
        base = r.get("direct", {}).get(field) if minus_direct else 0.0
        out.append(value - base if base is not None else NAN)
    return out


def summarize(raw: dict[str, Rounds]) -> dict[str, dict[str, float]]:
    """Per target: the medians over rounds the table shows (added = target - direct, per round)."""
    out: dict[str, dict[str, float]] = {}
    c1, s1 = raw.get("non-stream c=1", []), raw.get("stream c=1", [])
    c32, s32 = raw.get("non-stream c=32", []), raw.get("stream c=32", [])
    for target in TARGETS:
        out[target] = {
            "added_p50_ms": _median(_each(c1, target, "p50_ms", True)),
            "added_p99_ms": _median(_each(c1, target, "p99_ms", True)),
            "p50_ms": _median(_each(c1, target, "p50_ms", False)),
            "p99_ms": _median(_each(c1, target, "p99_ms", False)),
            "stream_added_p50_ms": _median(_each(s1, target, "p50_ms", True)),
            "stream_added_ttft_ms": _median(_each(s1, target, "ttft_p50_ms", True)),
            "stream_p50_ms": _median(_each(s1, target, "p50_ms", False)),
            "stream_ttft_ms": _median(_each(s1, target, "ttft_p50_ms", False)),
            "rps_c32": _median(_each(c32, target, "rps", False)),
            "stream_rps_c32": _median(_each(s32, target, "rps", False)),
        }
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else NAN


@dataclass
class Check:
    target: str    # the words
    value: str     # what was measured
    met: bool | None  # None: not measured


def checks(s: dict[str, dict[str, float]]) -> list[Check]:
    """The issue's "Done when" targets this benchmark measures."""
    adm, gov, plain, lite = s["admin"], s["governed"], s["plain"], s["litellm"]
    out: list[Check] = []

    def add(target: str, value: float, limit: float, fmt: Callable[[float, float], str],
            at_most: bool = True) -> None:
        met = None if math.isnan(value) or math.isnan(limit) else (value <= limit if at_most else value >= limit)
        out.append(Check(target, fmt(value, limit), met))

    add("stream c=1: our added p50 <= 1.5x the plain proxy's", adm["stream_added_p50_ms"],
        1.5 * plain["stream_added_p50_ms"], lambda v, lim: f"admin {v:.2f} ms, limit {lim:.2f} ms")
    add("stream c=1: our added TTFT <= 1 ms", adm["stream_added_ttft_ms"], 1.0,
        lambda v, _lim: f"admin {v:.2f} ms")
    add("stream c=32: our req/s >= the plain proxy's", adm["stream_rps_c32"], plain["stream_rps_c32"],
        lambda v, lim: f"admin {v:.0f} req/s, plain proxy {lim:.0f}", at_most=False)
    add("non-stream c=1: added p50 <= 1.2 ms, admin key", adm["added_p50_ms"], 1.2, lambda v, _l: f"{v:.2f} ms")
    add("non-stream c=1: added p50 <= 1.6 ms, governed key", gov["added_p50_ms"], 1.6,
        lambda v, _l: f"{v:.2f} ms")
    add("non-stream c=1: governed p99 <= 2.5x its p50", gov["p99_ms"], 2.5 * gov["p50_ms"],
        lambda v, lim: f"p99 {v:.2f} ms, limit {lim:.2f} ms (p50 {gov['p50_ms']:.2f})")
    def times(o: float, p: float) -> Callable[[float, float], str]:
        return lambda v, _lim: f"{v:.1f}x ({o:.0f} vs {p:.0f} req/s)"

    for label, ours in (("admin", adm), ("governed", gov)):
        for field, kind in (("rps_c32", "non-stream"), ("stream_rps_c32", "stream")):
            add(f"{kind} c=32: >= 8x LiteLLM's req/s, {label} key", _ratio(ours[field], lite[field]), 8.0,
                times(ours[field], lite[field]), at_most=False)
    return out


# ---------------------------------------------------------------------------------------------
# Rendering


def _ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f} ms"


def _rps(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.0f}"


def _x(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}×"


def table(s: dict[str, dict[str, float]]) -> list[str]:
    lines = ["| in front of the stub | added p50 c=1 | added p99 c=1 | stream: added p50 / added TTFT c=1 "
             "| req/s c=32 | stream req/s c=32 |", "|---|---|---|---|---|---|"]
    for t in ROWS:
        r = s[t]
        lines.append(f"| {TARGETS[t]} | {_ms(r['added_p50_ms'])} | {_ms(r['added_p99_ms'])} | "
                     f"{_ms(r['stream_added_p50_ms'])} / {_ms(r['stream_added_ttft_ms'])} | "
                     f"{_rps(r['rps_c32'])} | {_rps(r['stream_rps_c32'])} |")
    d = s["direct"]
    lines.append(f"| {TARGETS['direct']}: the baseline | p50 {_ms(d['p50_ms'])} | p99 {_ms(d['p99_ms'])} | "
                 f"p50 {_ms(d['stream_p50_ms'])} / TTFT {_ms(d['stream_ttft_ms'])} | "
                 f"{_rps(d['rps_c32'])} | {_rps(d['stream_rps_c32'])} |")
    return lines


def ratios(s: dict[str, dict[str, float]]) -> list[str]:
    lines = ["| ours ÷ peer | added p50 c=1 | stream added p50 c=1 | stream added TTFT c=1 | req/s c=32 "
             "| stream req/s c=32 |", "|---|---|---|---|---|---|"]
    for ours in ("admin", "governed"):
        for peer in ("plain", "litellm"):
            o, p = s[ours], s[peer]
            cells = [_x(_ratio(o[f], p[f])) for f in ("added_p50_ms", "stream_added_p50_ms",
                                                     "stream_added_ttft_ms", "rps_c32", "stream_rps_c32")]
            lines.append(f"| {TARGETS[ours]} ÷ {TARGETS[peer].split(' (')[0]} | " + " | ".join(cells) + " |")
    return lines


def _round_lines(raw: dict[str, Rounds]) -> list[str]:
    lines = ["| point | target | per round: p50 / p99 / TTFT p50 ms, req/s, errors |", "|---|---|---|"]
    for point, rounds in raw.items():
        for t in TARGETS:
            cells = []
            for r in rounds:
                res = r.get(t)
                if res is None:
                    continue
                ttft = res.get("ttft_p50_ms")
                cells.append(f"{res['p50_ms']:.2f} / {res['p99_ms']:.2f} / "
                             f"{'-' if ttft is None else f'{ttft:.2f}'}, {res['rps']:.0f}, {res['errors']}")
            if cells:
                lines.append(f"| {point} | {t} | " + "; ".join(cells) + " |")
    return lines


def markdown(run: dict[str, Any]) -> str:
    """The results as Markdown: the table, the ratios, the checklist, the machine and each round."""
    s, m = run["summary"], run["machine"]
    v = m["versions"]
    lines = [f"# Peers in front of the same stub — {run['date']} on {m['hostname']} ({run['profile']} run)", "",
             f"{run['rounds']} rounds, targets interleaved in a rotating order per point, each warmed up; "
             f"{run['requests_c1']} sequential requests at 1 client, {run['requests_c32']} over 32 clients; "
             "the stub streams 8 `data:` events and `[DONE]`. Added = the target less the stub called "
             "directly, in the same round (median over rounds).", "", *table(s), "",
             "Ratios (added latency: below 1 means we add less; req/s: above 1 means we serve more):", "",
             *ratios(s), "", "## The issue's targets", ""]
    for c in run["checks"]:
        mark = "n/a: not measured" if c["met"] is None else ("met" if c["met"] else "NOT met")
        lines.append(f"- [{'x' if c['met'] else ' '}] {c['target']}: {c['value']} — **{mark}**")
    lines += ["- [ ] Redis SIGKILL under load keeps the loss bound: not measured here (the test suite's)", "",
              "## Machine", "",
              f"- CPU: {m['cpu_model']}, {m['cpus']} cores; memory {m['memory_gib']} GiB; kernel {m['kernel']}",
              f"- Python {m['python']}; ours {v['examlops-gateway']} (commit {m['commit']}), LiteLLM {v['litellm']}, "
              f"httpx {v['httpx']}, uvicorn {v['uvicorn']}, starlette {v['starlette']}",
              "- pinning: " + "; ".join(f"{k}: {p}" for k, p in m["pinning"].items())]
    lines += [f"- {k}: {m[k]}" for k in m if k not in (
        "hostname", "cpu_model", "cpus", "memory_gib", "kernel", "python", "commit", "versions", "pinning")]
    foreign = [res.get("foreign_cpu_cores", 0.0)
               for rounds in run["raw"].values() for r in rounds for res in r.values()]
    if foreign:
        lines.append(f"- CPU that processes outside the run used during a measured phase: up to {max(foreign):.2f} "
                     "cores (above ~0.15 the run was disturbed: numbers to repeat on an idle machine)")
    lines += ["", "## Each round", "", *_round_lines(run["raw"]), ""]
    return "\n".join(lines)


def _clean(obj: Any) -> Any:
    """NaN -> null, so the JSON file is standard JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def build_run(raw: dict[str, Rounds], machine: dict[str, Any], profile: str, date: str, rounds: int,
              requests_c1: int, requests_c32: int) -> dict[str, Any]:
    s = summarize(raw)
    return {"date": date, "profile": profile, "rounds": rounds, "requests_c1": requests_c1,
            "requests_c32": requests_c32, "machine": machine, "summary": s,
            "checks": [asdict(c) for c in checks(s)], "raw": raw}


def write_results(run: dict[str, Any], results_dir: Path) -> tuple[Path, Path]:
    """bench/results/peers-<UTC date>-<hostname>.json and .md (a later run of the same day replaces them)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"peers-{run['date'][:10]}-{run['machine']['hostname']}"
    js, md = results_dir / f"{stem}.json", results_dir / f"{stem}.md"
    js.write_text(json.dumps(_clean(run), indent=2) + "\n")
    md.write_text(markdown(run))
    return js, md


def unmeasured(run: dict[str, Any]) -> list[str]:
    return [c["target"] for c in run["checks"] if c["met"] is None]
