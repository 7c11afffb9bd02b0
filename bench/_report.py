"""The gateway benchmark's report: the table, and the verdict against ARCHITECTURE.md's budget."""

from __future__ import annotations

import os
import platform
from typing import Any

#: ARCHITECTURE.md "Performance budget": LiteLLM's throughput anchor (32 clients) and our targets.
LITELLM_RPS = {False: (80, 125), True: (50, 65)}
TARGET_ADDED_P50_MS = 2.0
TARGET_LITELLM_MULTIPLE = 4


def _f(v: float, fmt: str = "{:.2f}") -> str:
    return "—" if v != v else fmt.format(v)  # NaN → dash


def report(results: list[dict[str, Any]], profile_name: str) -> str:
    out = []
    cpus = os.cpu_count()
    out.append(f"\nGateway overhead ({profile_name} run; {cpus} CPUs, Python {platform.python_version()}, "
               "one gateway worker, loopback; same stub and client for both paths)\n")
    head = (f"{'scenario':<22} {'path':<8} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>9}   "
            f"{'CPU ms/request: gw+ep = gateway + engine-proxy':<48} {'stub':>6} {'busy*':>6}")
    out.append(head)
    out.append("-" * len(head))
    for row in results:
        d, g = row["direct"], row["gateway"]
        for target, res in (("direct", d), ("gateway", g)):
            cpu = res["cpu_ms_per_request"]
            gw_ep = (f"{cpu['gateway'] + cpu['engine-proxy']:.2f} = {cpu['gateway']:.2f} + {cpu['engine-proxy']:.2f}"
                     if target == "gateway" else "")
            err = f"  ({res['errors']} errors)" if res["errors"] else ""
            out.append(f"{row['scenario'] if target == 'direct' else '':<22} {target:<8} {res['count']:>6} "
                       f"{_f(res['p50_ms']):>8} {_f(res['p99_ms']):>8} {res['rps']:>9.0f}   {gw_ep:<48} "
                       f"{cpu['stub']:>6.3f} {res['foreign_cpu_cores']:>6.2f}{err}")
        ratio = g["rps"] / d["rps"] if d["rps"] else float("nan")
        out.append(f"{'':<22} {'added':<8} {'':>6} {'+' + _f(g['p50_ms'] - d['p50_ms']):>8} "
                   f"{'+' + _f(g['p99_ms'] - d['p99_ms']):>8} {'×' + _f(ratio, '{:.3f}'):>9}")
        out.append("")
    by = {(r["stream"], r["concurrency"]): r for r in results}
    out.append("Against the performance budget (ARCHITECTURE.md; LiteLLM and pass-through anchors measured there):")
    for stream in (False, True):
        kind = "stream    " if stream else "non-stream"
        lat, thr = by[(stream, 1)], by[(stream, 32)]
        added = lat["gateway"]["p50_ms"] - lat["direct"]["p50_ms"]
        rps = thr["gateway"]["rps"]
        lo, hi = LITELLM_RPS[stream]
        verdict_lat = "within" if added < TARGET_ADDED_P50_MS else "OVER"
        verdict_thr = "meets" if rps >= TARGET_LITELLM_MULTIPLE * hi else (
            "meets only vs the low anchor" if rps >= TARGET_LITELLM_MULTIPLE * lo else "BELOW")
        out.append(f"  {kind}: added p50 {added:.2f} ms (target < {TARGET_ADDED_P50_MS:.0f} ms: {verdict_lat}); "
                   f"{rps:.0f} req/s at 32 clients = {rps / hi:.1f}–{rps / lo:.1f}× LiteLLM's {lo}–{hi} "
                   f"(target ≥ {TARGET_LITELLM_MULTIPLE}×: {verdict_thr})")
    client = max(r["gateway"]["cpu_ms_per_request"]["client"] for r in results)
    direct_client = max(r["direct"]["cpu_ms_per_request"]["client"] for r in results)
    other = max(r["gateway"]["cpu_ms_per_request"]["other"] for r in results)
    out.append(f"  (load generator: ≤ {direct_client:.3f} ms CPU/request direct, ≤ {client:.3f} through the gateway; "
               f"registry+mediaguard+launcher+Redis: ≤ {other:.3f} ms/request)")
    out.append("  * busy: CPUs that processes other than the benchmark's kept busy during the measurement")
    conns = max(r["gateway"]["backend_connections_per_request"] for r in results)
    if conns > 0.1:
        worst = max(results, key=lambda r: r["gateway"]["backend_connections_per_request"])
        out.append(f"  NOTE: through the gateway the stub accepted {conns:.2f} new connections per request "
                   f"({worst['scenario']}): the engine-proxy → backend connection is not reused")
    foreign = max(res["foreign_cpu_cores"] for r in results for res in (r["direct"], r["gateway"]))
    if foreign > 0.15:
        out.append(f"  WARNING: other processes on this machine used up to {foreign:.2f} of its {cpus} CPUs during "
                   "a measurement; run again on an idle machine for numbers to compare")
    return "\n".join(out)
