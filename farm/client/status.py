"""``farm status``: the broker's INFO snapshot as aligned text, like ``supervisorctl status``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from farm.summary import per_second


def duration(seconds: float | None) -> str:
    """``0:01:05``-style; ``-`` when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Columns as wide as their widest cell; ``right``: indices of right-aligned columns."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = []
    for row in [headers, *rows]:
        cells = [
            str(cell).rjust(width) if index in right else str(cell).ljust(width)
            for index, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def worker_rows(workers: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for w in sorted(workers, key=lambda w: w["name"]):
        engines = w.get("engines", {})
        models = (
            ", ".join(
                f"{name} ({engines[name]})" if name in engines else name
                for name in w.get("loaded", [])
            )
            or "-"
        )
        sharing = int(w.get("device_shared_by", 1))  # workers on its device, itself included
        rows.append(
            [
                w["name"] + (f" (device shared by {sharing})" if sharing > 1 else ""),
                w["backend"],
                w["state"].upper(),
                f"{w['rate']:,.0f}",
                f"{w['busy_share']:.0%}",
                f"{w['in_flight']}/{w['slots']}",
                f"{w['heartbeat_age_s']:.1f}s",
                f"{w['items_done']:,}",
                models,
            ]
        )
    return rows


def job_rows(jobs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for j in jobs:
        share = j["done"] / j["total"] if j["total"] else 0.0
        rows.append(
            [
                j["job"][:12],
                j["client"] or "-",
                j["model"],
                j["policy"],
                str(j["priority"]),
                j["state"].upper(),
                f"{j['done']:,}/{j['total']:,} {share:.0%}",
                f"{j['rate']:,.0f}",
                duration(j["eta_s"]),
                str(j["in_flight"]),
            ]
        )
    return rows


#: The workers table's columns, and the indices of those aligned right.
WORKER_HEADERS = (
    "NAME",
    "BACKEND",
    "STATE",
    "IMAGES/S",
    "BUSY",
    "CHUNKS",
    "HEARTBEAT",
    "IMAGES DONE",
    "MODELS",
)
WORKER_RIGHT = {3, 4, 5, 6, 7}
#: The jobs table's columns, and the indices of those aligned right.
JOB_HEADERS = (
    "JOB",
    "CLIENT",
    "MODEL",
    "POLICY",
    "PRI",
    "STATE",
    "PROGRESS",
    "IMAGES/S",
    "ETA",
    "CHUNKS",
)
JOB_RIGHT = {4, 6, 7, 8, 9}


def format_status(snapshot: dict[str, Any]) -> str:
    """The broker's lines, then a workers table and a jobs table (jobs in the order they
    are offered free workers)."""
    workers, jobs = snapshot["workers"], snapshot["jobs"]
    lines = [*broker_lines(snapshot), ""]
    busy = sum(1 for w in workers if w["state"] == "busy")
    lines.append(
        f"WORKERS  {len(workers)} ({busy} busy), "
        f"{per_second(sum(w['rate'] for w in workers))} over the last 5 s"
    )
    if workers:
        lines += table(WORKER_HEADERS, worker_rows(workers), WORKER_RIGHT)
    lines += ["", f"JOBS  {len(jobs)}"]
    if jobs:
        lines += table(JOB_HEADERS, job_rows(jobs), JOB_RIGHT)
    return "\n".join(lines)


def broker_lines(snapshot: dict[str, Any]) -> list[str]:
    """The broker's address, uptime and policy; how its jobs ended; what it recovered
    from; the traffic through it."""
    ended = snapshot.get("jobs_ended", {})
    lines = [
        f"broker {snapshot['endpoint']}  up {duration(snapshot['uptime_s'])}  "
        f"policy {snapshot['policy']}  sharing {snapshot['sharing']}"
        + (f"  metrics {snapshot['metrics']}" if snapshot.get("metrics") else ""),
        "jobs ended: "
        + (
            ", ".join(
                f"{count} {outcome.replace('_', ' ')}" for outcome, count in ended.items() if count
            )
            or "none yet"
        ),
    ]
    events = {name: count for name, count in snapshot.get("stats", {}).items() if count}
    if events:
        lines.append(
            "recovered from: "
            + ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in events.items())
        )
    traffic = snapshot.get("traffic")
    if traffic:
        lines.append(
            f"through the broker: {sum(traffic['received'].values()):,} messages in, "
            f"{sum(traffic['sent'].values()):,} out; jobs' inputs (or where they lie) "
            f"{traffic['input_bytes'] / 1e6:,.1f} MB"
        )
    return lines
