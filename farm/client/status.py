"""``farm status``: the broker's INFO snapshot as aligned text, like ``supervisorctl status``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from farm.summary import per_second, plural


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
                worker_state(w),
                f"{w['rate']:,.0f}",
                f"{w['busy_share']:.0%}",
                f"{w['in_flight']}/{w['slots']}",
                f"{w['heartbeat_age_s']:.1f}s",
                f"{w['items_done']:,}",
                models,
            ]
        )
    return rows


def worker_state(worker: dict[str, Any]) -> str:
    """The STATE cell: ``BUSY``, ``STRAGGLING`` (a chunk past twice its predicted time),
    ``IDLE`` or ``QUARANTINED``, with its strikes (answers that failed the broker's checks)
    when it has some."""
    strikes = int(worker.get("strikes", 0))
    return worker["state"].upper() + (f" ({plural(strikes, 'strike')})" if strikes else "")


def worker_notes(workers: list[dict[str, Any]]) -> list[str]:
    """A line for each quarantined worker: why it gets no more tasks."""
    return [
        f"  {w['name']} quarantined: {w['quarantined']}"
        for w in sorted(workers, key=lambda w: w["name"])
        if w.get("quarantined")
    ]


def job_notes(jobs: list[dict[str, Any]]) -> list[str]:
    """Lines on jobs whose answers failed the broker's checks, on jobs in their tail
    (backup attempts), and on parked ones."""
    lines = [
        f"  {j['job'][:12]}: {plural(j['bad_answers'], 'answer')} failed the broker's "
        f"checks and ran again elsewhere"
        for j in jobs
        if j.get("bad_answers")
    ]
    lines += [
        f"  {j['job'][:12]}: in its tail for {j['tail_s']:.1f} s (a worker idle with nothing "
        f"left); backup attempts: {plural(j.get('backups', 0), 'chunk')}, "
        f"{j.get('backup_wins', 0):,} won"
        for j in jobs
        if j.get("tail_s") is not None
    ]
    if any(j.get("parked") for j in jobs):
        lines.append(
            "  PARKED: the job's client left a NEED unanswered; its slots go to other jobs "
            "until it answers"
        )
    return lines


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
                "PARKED" if j.get("parked") else j["state"].upper(),
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


#: The line under JOBS when the broker showed a peer that is no operator its own jobs only.
OWN_JOBS_NOTE = (
    "showing your own jobs only: connect from the broker's host or with an operator key "
    "for the whole farm"
)

#: ``FarmStats`` counters of what the broker refused to trust, as (one, several) nouns;
#: the other counters are what it recovered from.
GUARD_COUNTERS = {
    "refused_messages": ("refused message", "refused messages"),
    "bad_answers": ("answer that failed the checks", "answers that failed the checks"),
    "quarantined_workers": ("quarantined worker", "quarantined workers"),
    "parked_jobs": ("parked job", "parked jobs"),
    "refused_fetches": ("refused fetch", "refused fetches"),
}


def format_status(snapshot: dict[str, Any]) -> str:
    """The broker's lines, then a workers table and a jobs table (jobs in the order they
    are offered free workers), each followed by its notes (why workers are quarantined,
    jobs' refused answers, what PARKED means); a line when it shows the peer's jobs only."""
    workers, jobs = snapshot["workers"], snapshot["jobs"]
    lines = [*broker_lines(snapshot), ""]
    busy = sum(1 for w in workers if w["state"] in ("busy", "straggling"))
    lines.append(
        f"WORKERS  {len(workers)} ({busy} busy), "
        f"{per_second(sum(w['rate'] for w in workers))} over the last 5 s"
    )
    if workers:
        lines += table(WORKER_HEADERS, worker_rows(workers), WORKER_RIGHT)
        lines += worker_notes(workers)
    lines += ["", f"JOBS  {len(jobs)}"]
    if snapshot.get("view") == "own jobs":
        lines.append(OWN_JOBS_NOTE)
    if jobs:
        lines += table(JOB_HEADERS, job_rows(jobs), JOB_RIGHT)
        lines += job_notes(jobs)
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
    stats = snapshot.get("stats", {})
    events = {name: count for name, count in stats.items() if count and name not in GUARD_COUNTERS}
    if events:
        lines.append(
            "recovered from: "
            + ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in events.items())
        )
    guarded = guard_line(stats)
    if guarded:
        lines.append(guarded)
    traffic = snapshot.get("traffic")
    if traffic:
        lines.append(
            f"through the broker: {sum(traffic['received'].values()):,} messages in, "
            f"{sum(traffic['sent'].values()):,} out; jobs' inputs (or where they lie) "
            f"{traffic['input_bytes'] / 1e6:,.1f} MB"
        )
    return lines


def guard_line(stats: dict[str, int]) -> str | None:
    """``not trusted: 2 refused messages, 1 quarantined worker``: the nonzero counters of
    ``GUARD_COUNTERS``; None when all are zero."""
    parts = [
        f"{stats[name]:,} {nouns[stats[name] != 1]}"
        for name, nouns in GUARD_COUNTERS.items()
        if stats.get(name)
    ]
    return "not trusted: " + ", ".join(parts) if parts else None
