"""A kit to drive ``FarmState`` by hand: the events a farm's peers send, and a driver.

The simulator, the state's tests and the scale bench (``bench/broker_scale.py``) all feed
the state with it.  Simulated workers run one model, ``MODEL``, whose items are one
float32 each; a NEED is answered with its DATA (``data_for``), a TASK with its RESULT
(``result_for``) or FAILED (``failure_for``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from farm.broker import events as ev
from farm.broker.facts import JobOptions, ModelFound, WorkerFacts
from farm.broker.inputs import PROBE
from farm.broker.state import FarmState

#: The model simulated workers run, its input (one float32 per item) and its digest.
MODEL, ITEM_SHAPE, DIGEST = "m", (1,), "digest"
#: The client of simulated jobs, unless another is named.
CLIENT = b"client"


def worker_facts(
    *,
    slots: int = 1,
    device: str = "cpu",
    host: str = "host",
    pid: int = 1,
    backend: str = "sim",
    model: str = MODEL,
    speeds: dict[str, tuple[int, float]] | None = None,
) -> WorkerFacts:
    """A simulated worker that runs ``model``; ``speeds``: what it ran before (model ->
    images, compute seconds)."""
    return WorkerFacts(
        device=device,
        host=host,
        pid=pid,
        backend=backend,
        threads=1,
        models={model: ITEM_SHAPE},
        loaded=frozenset({model}),
        slots=slots,
        speeds=dict(speeds or {}),
    )


def joined(worker: bytes, at: float = 0.0, **facts: Any) -> ev.WorkerJoined:
    """``worker`` registers with ``worker_facts(**facts)``."""
    return ev.WorkerJoined(worker=worker, facts=worker_facts(**facts), at=at)


def submitted(
    job: str,
    total: int,
    *,
    at: float = 0.0,
    client: bytes = CLIENT,
    model: str = MODEL,
    item_shape: tuple[int, ...] = ITEM_SHAPE,
    heartbeat: float = 1.0,
    options: JobOptions | None = None,
    found: ModelFound | str | None = None,
) -> ev.JobSubmitted:
    """A job of ``total`` float32 items for ``model``; ``found``: what the repository says of
    the model (by default: it takes one float32 per item)."""
    return ev.JobSubmitted(
        client=client,
        job=job,
        model_name=model,
        dtype="float32",
        item_shape=item_shape,
        total=total,
        heartbeat=heartbeat,
        options=options or JobOptions(),
        model=found or ModelFound(item_shape=ITEM_SHAPE, digest=DIGEST),
        at=at,
    )


def data_for(need: ev.SendNeed, at: float) -> ev.DataArrived:
    """The client's answer to a NEED: the chunk's input."""
    return ev.DataArrived(
        client=need.client,
        job=need.job,
        chunk=need.chunk,
        start=need.start,
        count=need.count,
        at=at,
    )


def result_for(task: ev.SendTask, at: float, compute: float) -> ev.ResultArrived:
    """The worker's answer to a TASK: one float32 per item, computed in ``compute`` s."""
    return ev.ResultArrived(
        worker=task.worker,
        job=task.job,
        chunk=task.chunk,
        start=task.start,
        count=task.count,
        output_shape=ITEM_SHAPE,
        timings={"compute": compute},
        at=at,
    )


def failure_for(
    task: ev.SendTask, at: float, error: str, *, fatal: bool = False, charge: bool = True
) -> ev.FailureArrived:
    """The worker could not run a TASK."""
    return ev.FailureArrived(
        worker=task.worker,
        job=task.job,
        chunk=task.chunk,
        error=error,
        fatal=fatal,
        at=at,
        charge=charge,
    )


@dataclass
class Driver:
    """A ``FarmState`` fed by hand; ``sent``: every instruction it gave, in order (None:
    keep none)."""

    state: FarmState
    sent: list[ev.Instruction] | None = field(default_factory=list)

    def feed(self, event: ev.FarmEvent) -> list[ev.Instruction]:
        """One event in; the instructions it caused out."""
        out = self.state.handle(event)
        if self.sent is not None:
            self.sent += out
        return out

    def join(self, worker: bytes, at: float = 0.0, **facts: Any) -> list[ev.Instruction]:
        """``worker`` registers with ``worker_facts(**facts)``."""
        return self.feed(joined(worker, at, **facts))

    def submit(self, job: str, total: int, **how: Any) -> list[ev.Instruction]:
        """A job of ``total`` items, as ``submitted`` makes it, its probe answered."""
        return answer_probes(self.feed, self.feed(submitted(job, total, **how)))

    def answer(
        self, instruction: ev.SendNeed | ev.SendTask, at: float, compute: float = 0.0
    ) -> list[ev.Instruction]:
        """A NEED answered with its DATA, a TASK with its RESULT (``compute`` seconds)."""
        if isinstance(instruction, ev.SendNeed):
            return self.feed(data_for(instruction, at))
        return self.feed(result_for(instruction, at, compute))


def answer_probes(
    handle: Callable[[ev.FarmEvent], list[ev.Instruction]], instructions: list[ev.Instruction]
) -> list[ev.Instruction]:
    """``instructions`` with each probe (a NEED of chunk ``PROBE``: fair admission, see
    ``farm.broker.inputs``) answered by its client at once: what the answer caused takes
    its place."""
    out: list[ev.Instruction] = []
    for instruction in instructions:
        if isinstance(instruction, ev.SendNeed) and instruction.chunk == PROBE:
            out += handle(data_for(instruction, 0.0))
        else:
            out.append(instruction)
    return out
