"""A job's trace: for each chunk, which worker ran it and when it moved (``--trace``).

Times are seconds from the job's submission, on the broker's clock: when the
chunk was assigned (the broker asked for its input), sent to its worker,
arrived there, started and finished computing (between arrival and start it
waited behind the worker's previous chunk), and was received back by the
broker; plus when the client got it (client clock).  The worker reports how long it spent
receiving, computing and replying, and how much of its computing the device
itself was busy (for a GPU, measured by CUDA events), with its host-GPU copies; the network time
left over is split
evenly between the two directions to place the compute on the broker's clock
(as NTP does), so a trace from several hosts needs no synchronised clocks.

``farm report`` reads the file (``farm.client.report``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from farm.summary import FailedItems, JobSummary, WorkerShare, network_seconds, seconds_of
from farm.wire.messages import Result

TRACE_FORMAT: Literal["farm-trace/1"] = "farm-trace/1"


class ChunkTrace(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chunk's journey, in seconds since the job's first submission."""

    worker: str
    start: int  # the chunk's first item, in the job
    count: int
    attempt: int
    assigned: float
    sent: float
    arrived: float | None = None  # older traces lack it
    started: float
    finished: float
    received: float
    delivered: float  # on the client's clock
    device: float | None = None  # seconds its device computed (a GPU's, by CUDA events)
    copy: float | None = None  # seconds of host-GPU copies, overlapped with computing


class Trace(msgspec.Struct, kw_only=True):
    """A job's trace, as ``farm submit --trace`` writes it."""

    format: Literal["farm-trace/1"]
    job: str = ""
    model: str = "?"
    items: int  # images in the job
    policy: str = "?"
    broker_seconds: float
    shared: bool = False
    client_seconds: float | None = None
    cancelled: str | None = None
    workers: tuple[WorkerShare, ...]
    chunks: list[ChunkTrace]
    failed: list[FailedItems] = []


@dataclass
class TraceRecorder:
    """Collects chunk records as results arrive, across re-submissions."""

    started: float = field(default_factory=time.perf_counter)  # the first submission
    offset: float = 0.0  # the current submission's start, from the first
    chunks: list[ChunkTrace] = field(default_factory=list)

    def new_submission(self) -> None:
        """A (re-)submission starts now: its broker times count from here."""
        self.offset = time.perf_counter() - self.started

    def add(self, header: Result, item_start: int, count: int) -> None:
        """One chunk's RESULT header (``trace``, ``timings``, ``worker``, ``attempt``)."""
        if header.trace is None:
            return  # a broker that does not trace
        assigned, sent, received = (moment + self.offset for moment in header.trace)
        network = network_seconds(received - sent, header.timings)
        started = sent + network / 2 + seconds_of(header.timings.get("receive"))
        self.chunks.append(
            ChunkTrace(
                worker=header.worker or "?",
                start=item_start,
                count=count,
                attempt=header.attempt,
                assigned=assigned,
                sent=sent,
                arrived=sent + network / 2,
                started=started,
                finished=started + seconds_of(header.timings.get("compute")),
                received=received,
                delivered=time.perf_counter() - self.started,
                device=_optional_seconds(header.timings.get("device")),
                copy=_optional_seconds(header.timings.get("copy")),
            )
        )

    def document(
        self,
        job: str,
        model: str,
        items: int,
        summary: JobSummary | None,
        failed: list[FailedItems],
        cancelled: str | None,
    ) -> Trace:
        """The whole trace, for ``save_trace``."""
        client_seconds = time.perf_counter() - self.started
        broker_seconds = (
            self.offset + summary.broker_seconds if summary is not None else client_seconds
        )
        return Trace(
            format=TRACE_FORMAT,
            job=job,
            model=model,
            items=items,
            policy=summary.policy if summary else "?",
            broker_seconds=broker_seconds,
            shared=summary.shared if summary else False,
            client_seconds=client_seconds,
            cancelled=cancelled,
            workers=summary.workers if summary else (),
            chunks=self.chunks,
            failed=list(failed),
        )


def _optional_seconds(value: Any) -> float | None:
    """A time a worker may not report (older workers): None when absent."""
    return None if value is None else seconds_of(value)


def idle_share(trace: Trace) -> float:
    """The job's waste from its own trace: each worker's idle seconds between the job's
    start (its submission, 0) and its end (``broker_seconds``, the last result back at the
    broker), summed, over workers x that span.

    A worker is busy only while it computes a chunk: from ``started`` to ``finished``, the
    worker's own ``compute`` time (the forward passes, and the decoding of image files when
    the job sends files).  Receiving a chunk, waiting behind the previous one, replying,
    loading the model and chunks that failed all count as idle.  A worker's overlapping
    chunks count once, and time outside the span is cut off.  The workers are those the
    job was offered to and any that sent a result, so one that ran nothing is idle
    throughout.  Between 0 and 1 by construction, whatever the workers' speeds were
    before or after the job; 0 for a job with no span or no worker.
    """
    span = trace.broker_seconds
    names = {share.name for share in trace.workers} | {chunk.worker for chunk in trace.chunks}
    if span <= 0 or not names:
        return 0.0
    busy = sum(
        stretch.end - stretch.begin
        for name in names
        for stretch in busy_stretches(
            [chunk for chunk in trace.chunks if chunk.worker == name], span
        )
    )
    return max(0.0, 1.0 - busy / (len(names) * span))


class BusyStretch(NamedTuple):
    """A stretch of time one worker computed without a break, cut to the job's span."""

    begin: float
    end: float
    first: ChunkTrace  # the chunk that began it
    last: ChunkTrace  # the chunk that finished last in it (its end)


def busy_stretches(chunks: Iterable[ChunkTrace], span: float) -> list[BusyStretch]:
    """One worker's computing, in order: each chunk from ``started`` to ``finished`` cut to
    ``[0, span]``, chunks that overlap or touch merged into one stretch (a chunk wholly
    outside the span adds no time).  The trace's waste (``idle_share``) and ``farm
    report``'s breakdown of each worker's time (``farm.client.report``) both use it.
    """
    stretches: list[BusyStretch] = []
    for chunk in sorted(chunks, key=lambda c: c.started):
        begin = min(max(chunk.started, 0.0), span)
        end = min(max(chunk.finished, 0.0), span)
        if stretches and begin <= stretches[-1].end:
            if end > stretches[-1].end:
                stretches[-1] = stretches[-1]._replace(end=end, last=chunk)
            continue
        stretches.append(BusyStretch(begin, max(begin, end), chunk, chunk))
    return stretches


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace as JSON, one chunk per line (diffable, and grep finds a worker's)."""
    fields = msgspec.to_builtins(trace)
    chunks = ",\n  ".join(json.dumps(chunk) for chunk in fields.pop("chunks"))
    head = json.dumps(fields, indent=1)
    Path(path).write_text(
        head[:-2] + ',\n "chunks": [\n  ' + chunks + "\n ]\n}\n", encoding="utf-8"
    )
