"""Scan time of the built-in guardrail detectors on a 2 KB prompt of realistic chat text.

    .venv/bin/python bench/bench_guardrail_detectors.py [--runs 1000] [--no-freeze]

Prints p50, p99 and the longest single scan of each detector (pii with every entity, secrets, a
regex deny-list) and of all three together, as the gateway's input stage runs them, plus a baseline
measured in the same run: Presidio's stock recognizers (the phone recognizer over the whole text
once per region). The gateway runs scans on its event loop only while the longest scan stays under
5 ms; the verdict line says which. Issue 12's target: all detectors together ≤ 2 ms p50.
Presidio, spaCy and the suffix list put ~190,000 objects on the heap, so a full garbage collection
pauses for ~80 ms; `--no-freeze` shows it, by default the objects built at start are frozen
(`gc.freeze()`), as the gateway should do once its detectors are built.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

from examlops_gateway.guardrails import build_detector

PROMPT = (
    "Hi! I'm migrating our billing service from Python 3.9 to 3.11 and hit a few problems. Our CI runs\n"
    'pytest 8.1.1 on Ubuntu 22.04, and since the upgrade on 2024-03-15 the nightly job fails about one\n'
    'time in five. The failing test is test_invoice_rounding, which computes totals like $1,249.99 and\n'
    'EUR 87.50 for order #4827361 and ticket JIRA-2291. Here is the traceback (trimmed):\n'
    '\n'
    '  File "billing/invoice.py", line 212, in total\n'
    '    return round(sum(line.amount for line in self.lines), 2)\n'
    "  decimal.InvalidOperation: [<class 'decimal.ConversionSyntax'>]\n"
    '\n'
    'The lines come from a CSV export with about 12,000 rows; each row has an id (a UUID such as\n'
    '3f2b9c1e-8a4d-4e7b-9f10-2c6d5e8a7b90), a quantity, a unit price and a currency code. We read it\n'
    'with pandas 2.2.1 and convert with Decimal(str(value)). Rows with an empty price become NaN and I\n'
    'suspect that is what breaks. Could you suggest a robust way to parse these amounts, handle the\n'
    "empty values, and keep two-decimal rounding the accountants expect (banker's rounding is not OK for\n"
    'them, they want ROUND_HALF_UP)? Also, the commit that introduced the change was a1b2c3d in our\n'
    'repo, merged last Tuesday at 14:30 by the platform team. If you need the contact for the data team,\n'
    'it is data-team@example.com or +1 (415) 555-0132 during office hours, 9:00-17:00 PT.\n'
    '\n'
    'Another question: our Docker image is based on python:3.11-slim and weighs 1.2 GB, mostly because\n'
    'of numpy and pandas wheels. We deploy to 3 regions with 4 replicas each behind an nginx 1.25 proxy\n'
    'listening on port 8443. Would switching to polars 0.20 make the image smaller, and would the\n'
    'rounding behaviour stay the same? Please answer with a short plan in 5 steps, a code sample for the\n'
    'parsing function with type hints, and a note on how to test it with hypothesis 6.98. Keep the\n'
    'answer under 400 words if you can; the team reads it during the stand-up at 10:15 tomorrow. Thanks\n'
    'a lot for your help, this has been blocking the release of version 4.7.2 for a week now and the\n'
    'customer (account 0042-7781) is waiting for the corrected invoices for March and April 2024.\n'
)
LOOP_BUDGET_MS = 5.0
TARGET_P50_MS = 2.0


def measure(scan: Callable[[str], object], runs: int) -> tuple[float, float, float]:
    """p50, p99 and max of `runs` scans of PROMPT, in milliseconds, after a warm-up."""
    for _ in range(20):
        scan(PROMPT)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        scan(PROMPT)
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1], times[-1]


def stock_presidio() -> Callable[[str], object]:
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        IbanRecognizer,
        IpRecognizer,
        PhoneRecognizer,
        UsSsnRecognizer,
    )
    recognizers = [r() for r in (CreditCardRecognizer, IbanRecognizer, IpRecognizer, PhoneRecognizer, UsSsnRecognizer)]
    return lambda text: [r.analyze(text, r.supported_entities, None) for r in recognizers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--no-freeze", action="store_true", help="leave start-up objects to the garbage collector")
    args = parser.parse_args()
    runs = args.runs
    pii, secrets = build_detector("pii"), build_detector("secrets")
    deny = build_detector("regex", pattern=r"(?i)\bproject\s{1,3}(?:falcon|osprey)\b")
    if not args.no_freeze:
        gc.freeze()
    rows = {"pii (all entities)": pii.scan, "secrets": secrets.scan, "regex (deny-list)": deny.scan,
            "all three": lambda t: (pii.scan(t), secrets.scan(t), deny.scan(t)),
            "baseline: stock Presidio (no email)": stock_presidio()}
    frozen = "start-up objects not frozen" if args.no_freeze else "gc.freeze() after start-up"
    print(f"\nGuardrail scan time, {len(PROMPT.encode())} B prompt, {runs} runs each, {frozen} (ms)\n")
    print(f"{'detector':<38} {'p50':>7} {'p99':>7} {'max':>7}")
    results = {}
    for name, scan in rows.items():
        results[name] = measure(scan, runs)
        p50, p99, worst = results[name]
        print(f"{name:<38} {p50:>7.3f} {p99:>7.3f} {worst:>7.3f}")
    p50 = results["all three"][0]
    worst = max(worst for name, (_, _, worst) in results.items() if not name.startswith("baseline"))
    verdict = "met" if p50 <= TARGET_P50_MS else "MISSED"
    print(f"\nall three: p50 {p50:.2f} ms (target ≤ {TARGET_P50_MS} ms: {verdict}); "
          f"longest single scan {worst:.2f} ms (event-loop budget {LOOP_BUDGET_MS} ms: "
          f"{'within' if worst <= LOOP_BUDGET_MS else 'EXCEEDED: run scans in a thread'})")


if __name__ == "__main__":
    main()
