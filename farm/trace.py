"""A job's trace: for each chunk, which worker ran it and when it moved (``--trace``).

Times are seconds from the job's submission, on the broker's clock: when the
chunk was assigned (the broker asked for its input), sent to its worker,
arrived there, started and finished computing (between arrival and start it
waited behind the worker's previous chunk), and was received back by the
broker; plus when the client got it (client clock).  The worker reports how long it spent
receiving, computing and replying; the network time left over is split
evenly between the two directions to place the compute on the broker's clock
(as NTP does), so a trace from several hosts needs no synchronised clocks.

``farm report`` reads the file (``farm.report``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_FORMAT = "farm-trace/1"


@dataclass
class TraceRecorder:
    """Collects chunk records as results arrive, across re-submissions."""

    started: float = field(default_factory=time.perf_counter)  # the first submission
    offset: float = 0.0  # the current submission's start, from the first
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def new_submission(self) -> None:
        """A (re-)submission starts now: its broker times count from here."""
        self.offset = time.perf_counter() - self.started

    def add(self, header: dict[str, Any], item_start: int, count: int) -> None:
        """One chunk's RESULT header (``trace``, ``timings``, ``worker``, ``attempt``)."""
        moments, timings = header.get("trace"), header.get("timings", {})
        if not (isinstance(moments, list) and len(moments) == 3 and all(
                isinstance(t, (int, float)) and math.isfinite(t) for t in moments)):
            return  # a broker that does not trace
        assigned, sent, received = moments
        network = network_seconds(received - sent, timings)
        started = sent + network / 2 + _seconds(timings.get("receive"))
        shift = self.offset
        self.chunks.append({
            "worker": str(header.get("worker", "?")), "start": item_start, "count": count,
            "attempt": header.get("attempt", 1), "assigned": assigned + shift,
            "sent": sent + shift, "arrived": sent + network / 2 + shift,
            "started": started + shift,
            "finished": started + _seconds(timings.get("compute")) + shift,
            "received": received + shift,
            "delivered": time.perf_counter() - self.started})

    def document(self, job: str, model: str, items: int, summary: dict[str, Any] | None,
                 failed: list[Any], cancelled: str | None) -> dict[str, Any]:
        """The whole trace, ready for ``json.dump``."""
        client_seconds = time.perf_counter() - self.started
        summary = summary or {}
        broker_seconds = (self.offset + float(summary["broker_seconds"])
                          if "broker_seconds" in summary else client_seconds)
        return {"format": TRACE_FORMAT, "job": job, "model": model, "items": items,
                "policy": summary.get("policy", "?"), "broker_seconds": broker_seconds,
                "shared": bool(summary.get("shared", False)),
                "client_seconds": client_seconds, "cancelled": cancelled,
                "workers": summary.get("workers", []), "chunks": self.chunks,
                "failed": [{"start": f.start, "count": f.count, "error": f.error}
                           for f in failed]}


def network_seconds(round_trip: float, timings: dict[str, Any]) -> float:
    """The part of a chunk's round trip (TASK sent to RESULT back) spent on the network, both
    ways: what the worker's receive, compute and send times leave over."""
    spent = sum(_seconds(timings.get(key)) for key in ("receive", "compute", "send"))
    return max(0.0, round_trip - spent)


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def save_trace(trace: dict[str, Any], path: str | Path) -> None:
    """Write a trace as JSON, one chunk per line (diffable, and grep finds a worker's)."""
    head = json.dumps({key: value for key, value in trace.items() if key != "chunks"}, indent=1)
    chunks = ",\n  ".join(json.dumps(chunk) for chunk in trace["chunks"])
    Path(path).write_text(head[:-2] + ',\n "chunks": [\n  ' + chunks + "\n ]\n}\n",
                          encoding="utf-8")
