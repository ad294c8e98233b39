"""Summary of a locust run of ``loadtest/locustfile.py``: figures per task kind and a PNG over time.

Reads locust's final statistics (``--json-file PREFIX``, written after the
last stream has ended: the CSV totals are written when the run stops, before
running streams finish), its CSV history (``--csv PREFIX --csv-full-history``,
for the plot and the capacity) and the locustfile's ``--outputs-json``;
prints (and writes as JSON) per kind:
requests/s, output tokens/s, time to first token and inter-token latency
p50/p95/p99, closed-early outputs, failures by reason; and plots requests/s,
user count and inter-token p99 over time.  ``capacity`` finds, in a ramp,
the most users whose inter-token p99 stayed under a bound.

Usage: ``python loadtest/summary.py PREFIX [--outputs-json F] [--png F] [--json F] [--itl-bound-ms MS]``
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PERCENTILES = ("50%", "95%", "99%")
#: Locust request types of whole requests: gRPC streams and the ``openai`` task's HTTP streams.
REQUEST_TYPES = ("grpc", "http")


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:  # locust writes "N/A" for an empty percentile
        return math.nan


def _kind(name: str) -> str:
    """The task kind of an entry name (``bad:regex`` -> ``bad``)."""
    return name.split(":", 1)[0]


def percentile(histogram: dict[str, int], q: float) -> float:
    """Percentile ``q`` (0-100) of locust's response-time histogram (rounded ms -> count); NaN when empty."""
    points = sorted((float(ms), count) for ms, count in histogram.items())
    total = sum(count for _, count in points)
    if not total:
        return math.nan
    seen = 0
    for ms, count in points:
        seen += count
        if seen >= q / 100 * total:
            return ms
    return points[-1][0]


def summarize(prefix: Path, outputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-kind figures of one run.

    Returns
    -------
    dict
        ``duration_s``, ``kinds`` (kind -> requests, failures, requests_s,
        output_tokens_s, ttft_ms and itl_ms percentiles, outputs) and
        ``failures`` (kind -> reason -> occurrences, from ``--outputs-json``).
    """
    entries = json.loads(Path(f"{prefix}.json").read_text())
    starts = [e["start_time"] for e in entries]
    ends = [e["last_request_timestamp"] for e in entries if e["last_request_timestamp"]]
    duration = max(max(ends, default=0.0) - min(starts, default=0.0), 1.0)
    kinds: dict[str, dict[str, Any]] = defaultdict(lambda: {"requests": 0, "failures": 0, "tokens": 0})
    for entry in entries:
        kind, name = entry["method"], entry["name"]
        if kind in REQUEST_TYPES:
            figures = kinds[_kind(name)]
            figures["requests"] += entry["num_requests"]
            figures["failures"] += entry["num_failures"]
            figures["tokens"] += entry["total_content_length"]
        elif kind in ("ttft", "itl"):
            kinds[name][f"{kind}_ms"] = {f"{q}%": percentile(entry["response_times"], q) for q in (50, 95, 99)}
            kinds[name][f"{kind}_count"] = entry["num_requests"]
    outcomes = (outputs or {}).get("outcomes", {})
    for kind, figures in kinds.items():
        figures["requests_s"] = figures["requests"] / duration
        figures["output_tokens_s"] = figures.pop("tokens") / duration
        figures["outputs"] = outcomes.get(kind, {})
    return {"duration_s": round(duration, 1), "kinds": dict(kinds), "failures": (outputs or {}).get("failures", {})}


def capacity(prefix: Path, kind: str, itl_bound_ms: float) -> int | None:
    """The most users at which ``kind``'s windowed inter-token p99 stayed within the bound (None: never)."""
    best: int | None = None
    worst_at: dict[int, float] = {}
    for row in _read(Path(f"{prefix}_stats_history.csv")):
        if row["Type"] == "itl" and row["Name"] == kind:
            users, p99 = int(row["User Count"]), _number(row["99%"])
            if not math.isnan(p99):
                worst_at[users] = max(worst_at.get(users, 0.0), p99)
    for users in sorted(worst_at):
        if worst_at[users] > itl_bound_ms:
            break
        best = users
    return best


def plot(prefix: Path, png: Path) -> None:
    """Requests/s per kind, users, and inter-token p99 per kind over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(Path(f"{prefix}_stats_history.csv"))
    if not rows:
        return
    t0 = min(int(r["Timestamp"]) for r in rows)
    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    users: dict[int, int] = {}
    for r in rows:
        t = int(r["Timestamp"]) - t0
        users[t] = int(r["User Count"])
        if r["Type"] in REQUEST_TYPES:
            series["rps", _kind(r["Name"])].append((t, _number(r["Requests/s"])))
        elif r["Type"] == "itl":
            series["itl", r["Name"]].append((t, _number(r["99%"])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    names = sorted({name for _, name in series})
    colour = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}  # one colour per kind
    rps: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (what, name), points in series.items():
        if what == "rps":
            for t, v in points:
                rps[name][t] += 0.0 if math.isnan(v) else v
    for name, points_by_t in sorted(rps.items()):
        ts = sorted(points_by_t)
        top.plot(ts, [points_by_t[t] for t in ts], label=name, color=colour[name])
    top.set_ylabel("requests/s")
    twin = top.twinx()
    ts = sorted(users)
    twin.plot(ts, [users[t] for t in ts], color="grey", linestyle="--", label="users")
    twin.set_ylabel("users")
    top.legend(loc="upper left", fontsize="small")
    for (what, name), points in sorted(series.items()):
        if what == "itl":
            bottom.plot([t for t, _ in points], [v for _, v in points], label=name, color=colour[name])
    bottom.set_ylabel("inter-token p99, ms")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def render(summary: dict[str, Any]) -> str:
    """The summary as a text table."""
    lines = [f"duration {summary['duration_s']} s (first request to last response)"]
    head = f"{'kind':14s} {'req':>6s} {'fail':>5s} {'req/s':>7s} {'tok/s':>7s}  ttft p50/p95/p99 ms   itl p50/p95/p99 ms"
    lines.append(head)
    for kind, f in sorted(summary["kinds"].items()):
        if "requests" not in f or not f["requests"]:
            continue

        def trio(key: str, figures: dict[str, Any] = f) -> str:
            values = figures.get(key)
            return "-" if values is None else "/".join(f"{values[p]:.0f}" for p in PERCENTILES)

        lines.append(f"{kind:14s} {f['requests']:6d} {f['failures']:5d} {f['requests_s']:7.2f} "
                     f"{f['output_tokens_s']:7.1f}  {trio('ttft_ms'):20s} {trio('itl_ms'):20s} {f.get('outputs', '')}")
    for kind, reasons in sorted(summary["failures"].items()):
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"failure {kind}: {count} x {reason}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the summary of a run; write JSON and PNG when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", type=Path, help="locust's --csv prefix")
    parser.add_argument("--outputs-json", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--itl-bound-ms", type=float, default=None,
                        help="also report, per kind, the most users whose inter-token p99 stayed under this")
    args = parser.parse_args(argv)
    outputs = json.loads(args.outputs_json.read_text()) if args.outputs_json and args.outputs_json.is_file() else None
    summary = summarize(args.prefix, outputs)
    if args.itl_bound_ms is not None:
        summary["capacity"] = {kind: capacity(args.prefix, kind, args.itl_bound_ms)
                               for kind in summary["kinds"] if "itl_ms" in summary["kinds"][kind]}
        summary["itl_bound_ms"] = args.itl_bound_ms
    print(render(summary))
    if "capacity" in summary:
        print(f"capacity (inter-token p99 <= {args.itl_bound_ms:.0f} ms): {summary['capacity']}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    if args.png is not None:
        plot(args.prefix, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
