"""The broker's wire adapter: decoded messages in, events out; instructions in, messages out.

The only module that maps the protocol (``farm.wire.protocol``, ``farm.wire.messages``) onto the
scheduling core (``farm.broker.state`` and its events, which import neither).  Besides
the mapping it makes the checks a message needs beyond its own decoding: a worker's
advertised models, a job's dtype, and a chunk's input (DATA) and outputs
(RESULT) against the attempt the state awaits.  A check that fails becomes the event's
``problem``: the state fails the job for a bad DATA (its client's own input), and runs
the chunk again on another worker for a bad RESULT (``farm.broker.quarantine``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from farm.broker import events as ev
from farm.broker.facts import JobOptions, ModelFound, WorkerFacts
from farm.broker.jobs import ChunkRecord, Job
from farm.broker.state import FarmState
from farm.wire import messages, protocol
from farm.wire.messages import Header, StoredInputs
from farm.wire.protocol import Message, ProtocolError
from farm.wire.shapes import ENCODED
from farm.wire.storage import SharedInputs, StoredError

log = logging.getLogger("farm.broker")

#: Longest error text sent: a reply must stay within the protocol's own string limits.
MAX_ERROR_CHARS = 1000
#: Timings a RESULT may report, in seconds; ``compute`` it must.
TIMINGS = ("compute", "receive", "send", "device", "copy", "load")

# ------------------------------------------------------------------------- messages in


def event_of(
    identity: bytes, message: Message, now: float, state: FarmState, owner: str = ""
) -> ev.FarmEvent:
    """The state's event for a message from a worker or a client (``state``: what it awaits,
    to check a chunk against; ``owner``: the peer's CURVE key, else its connection);
    ProtocolError if its facts do not add up."""
    match message.header:
        case messages.Ready() as ready:
            facts = dataclasses.replace(worker_facts(ready), owner=owner)
            return ev.WorkerJoined(worker=identity, facts=facts, at=now)
        case messages.Heartbeat(job=None, computed=computed, engines=engines):
            return ev.WorkerHeard(worker=identity, at=now, computed=computed, engines=engines)
        case messages.Heartbeat(job=str(job)):
            return ev.ClientHeard(client=identity, job=job, at=now)
        case messages.Result() as result:
            return result_arrived(
                identity,
                message,
                now,
                state.awaited_result(identity, result.chunk),
                state.running.get(result.job) if result.kept else None,
            )
        case messages.Failed() as failed:
            return ev.FailureArrived(
                worker=identity,
                job=failed.job,
                chunk=failed.chunk,
                error=failed.error,
                fatal=failed.fatal,
                at=now,
                charge=failed.charge,
                unshared=failed.unshared,
            )
        case messages.Data() as data:
            return ev.DataArrived(
                client=identity,
                job=data.job,
                chunk=data.chunk,
                start=data.start,
                count=data.count,
                at=now,
                payload=message.payload,
                problem=data_problem(
                    data, message.payload, state.awaited_input(data.job, data.chunk)
                ),
            )
        case messages.Disconnect():
            return ev.WorkerLeft(worker=identity, at=now)
        case messages.Cancel() as cancel:
            return ev.JobCancelled(client=identity, job=cancel.job, at=now)
    raise ProtocolError(f"{message.command.name} is not accepted here")


def worker_facts(header: messages.Ready) -> WorkerFacts:
    """A READY header's facts; ProtocolError if an advertised model's input cannot cross
    the wire.  ``loaded`` is a hint: names it lists that the worker does not advertise (a
    worker of an older farm, which advertised only its own disk's models) are dropped with
    a warning, never a refusal that would lock the worker out."""
    for model in header.models.values():  # an advertised model's input must fit in a frame
        protocol.check_array_spec("float32", model.input_shape)
    unknown = sorted(set(header.loaded) - set(header.models))
    if unknown:
        log.warning(
            "worker %s:%d/%s lists loaded models it does not advertise (%s): ignored",
            header.host,
            header.pid,
            header.device,
            ", ".join(unknown),
        )
    return WorkerFacts(
        device=header.device,
        host=header.host,
        pid=header.pid,
        backend=header.backend,
        threads=header.threads,
        models={name: tuple(model.input_shape) for name, model in header.models.items()},
        loaded=frozenset(header.loaded) - frozenset(unknown),
        slots=header.slots,
        heartbeat=header.heartbeat,
        engines=dict(header.engines),
        startup=dict(header.startup),
        speeds={
            model: (images, seconds)
            for model, (images, seconds) in header.speeds.items()
            if model in header.models and images > 0 and seconds > 0
        },
    )


def refusal(submit: messages.Submit) -> str | None:
    """Why a SUBMIT's items cannot cross the wire (its dtype or item shape), or None: the
    job is refused, a well-formed request, not a bad message."""
    try:
        protocol.check_array_spec(submit.dtype, submit.item_shape)
    except ProtocolError as exc:
        return str(exc)
    return None


def job_submitted(
    identity: bytes,
    message: Message,
    now: float,
    heartbeat: float,
    find_model: Callable[[str], ModelFound | str],
    owner: str = "",
) -> ev.JobSubmitted:
    """A SUBMIT, with what ``find_model`` (the broker's repository) says of its model;
    ``heartbeat``: the client's interval unless it gave one.  ProtocolError if its shared
    inputs do not fit it."""
    submit = message.header
    assert isinstance(submit, messages.Submit)
    options = job_options(submit.options)
    return ev.JobSubmitted(
        client=identity,
        job=submit.job,
        model_name=submit.model,
        dtype=submit.dtype,
        item_shape=tuple(submit.item_shape),
        total=submit.total,
        heartbeat=submit.heartbeat or heartbeat,
        options=options,
        model=find_model(submit.model),
        at=now,
        owner=owner,
        **submitted_with(message),
    )


def submitted_with(message: Message) -> dict[str, Any]:
    """What a SUBMIT's document says (``messages.SubmitDocument``): the job's shared
    inputs, checked against it, and its runs and its earlier submissions'."""
    document = message.document(messages.SubmitDocument)
    if document is None:
        return {}
    submit = message.header
    assert isinstance(submit, messages.Submit)
    if document.runs and sum(count for _, _, count in document.runs) != submit.total:
        raise ProtocolError(f"SUBMIT runs do not hold the job's {submit.total} items")
    return {
        "inputs": shared_inputs(document.inputs, submit),
        "runs": tuple(document.runs),
        "earlier": {job: tuple(runs) for job, runs in document.earlier.items()},
    }


def shared_inputs(stored: StoredInputs | None, submit: messages.Submit) -> SharedInputs | None:
    """A job's shared inputs (``farm.wire.storage``), checked against it; None if its client
    sends the items."""
    if stored is None:
        return None
    if (stored.kind == "files") != (submit.dtype == ENCODED):
        raise ProtocolError(f"shared {stored.kind} cannot hold a job of {submit.dtype} items")
    try:
        return SharedInputs.check(
            stored,
            submit.total,
            0
            if submit.dtype == ENCODED
            else protocol.check_array_spec(submit.dtype, submit.item_shape),
        )
    except StoredError as exc:
        raise ProtocolError(str(exc)) from None


def job_options(options: messages.Options) -> JobOptions:
    """SUBMIT options as the broker keeps them (types, ranges and the engine choice were
    checked on decode)."""
    params = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in options.params.items())
    return JobOptions(
        algo=options.algo,
        params=params,
        priority=options.priority,
        timeout=options.timeout,
        client=options.client,
        engine=options.engine,
        exif_rotate=options.exif_rotate,
        verify=options.verify,
    )


def data_problem(
    data: messages.Data, payload: Sequence[Any], awaited: ChunkRecord | None
) -> str | None:
    """Why a DATA cannot be the input of the ``awaited`` attempt (None: it can, or none
    awaits it): it must hold exactly the chunk's items, in the job's dtype."""
    if awaited is None:
        return None  # the state drops it: nothing waits for it
    job, chunk = awaited.job, awaited.chunk
    if (data.start, data.count) != (chunk.start, chunk.count):
        return (
            f"job {job.id}: DATA for items {data.start}+{data.count}, the broker asked "
            f"for {chunk.start}+{chunk.count}"
        )
    if job.dtype == ENCODED:
        try:
            protocol.check_files(payload, chunk.count, job.item_bytes)
        except ProtocolError as exc:
            return str(exc)
        return None
    if len(payload) != 1:
        return "DATA carries exactly one frame"
    size = protocol.payload_bytes(payload)
    if size != chunk.count * job.item_bytes:
        return f"job {job.id}: DATA of {size} bytes, expected {chunk.count} x {job.item_bytes}"
    return None


def result_arrived(
    identity: bytes, message: Message, now: float, awaited: ChunkRecord | None, kept_job: Any
) -> ev.ResultArrived:
    """A RESULT, its header and payload carried through for the client, checked against
    the ``awaited`` attempt (a kept result against its job, ``kept_job``, if running)."""
    result = message.header
    assert isinstance(result, messages.Result)
    if result.kept:
        problem = kept_problem(message, kept_job)
    else:
        problem = result_problem(message, awaited)
    return ev.ResultArrived(
        worker=identity,
        job=result.job,
        chunk=result.chunk,
        start=result.start,
        count=result.count,
        output_shape=tuple(result.item_shape),
        timings=result.timings,
        at=now,
        header=result,
        payload=message.payload,
        problem=problem.text if problem else None,
        in_values=bool(problem and problem.in_values),
        kept=result.kept,
        size=protocol.payload_bytes(message.payload),
        outputs=None if problem or awaited is None else message.array("float32", result.item_shape),
        failed=result.failed,
    )


def malformed_result(
    identity: bytes, header: messages.Result, problem: str, now: float
) -> ev.ResultArrived:
    """A worker's RESULT whose payload does not fit its header: refused like any answer
    that fails the checks, so that its chunk runs again elsewhere rather than waiting."""
    return ev.ResultArrived(
        worker=identity,
        job=header.job,
        chunk=header.chunk,
        start=header.start,
        count=header.count,
        output_shape=tuple(header.item_shape),
        timings={},
        at=now,
        header=header,
        problem=f"a malformed RESULT: {problem}",
        kept=header.kept,
    )


@dataclass(frozen=True)
class Problem:
    """Why a RESULT cannot be taken; ``in_values``: its values are wrong (not finite, out
    of range), which the images may cause, rather than its form."""

    text: str
    in_values: bool = False


def kept_problem(message: Message, job: Job | None) -> Problem | None:
    """Why a kept result (``Result.kept``) cannot go to a client: checked like any other
    against its job when this broker runs it (``job``), else as far as it can be alone."""
    result = message.header
    assert isinstance(result, messages.Result)
    if job is not None and result.start + result.count > job.total:
        return Problem(f"answers items {result.start}+{result.count} of a job of {job.total}")
    return answer_problem(message, job.output_shape if job else None, job.softmax if job else False)


def result_problem(message: Message, awaited: ChunkRecord | None) -> Problem | None:
    """Why a RESULT cannot be taken for the ``awaited`` attempt (None: it can, or none awaits
    it): exactly the chunk's items, then ``answer_problem``."""
    result = message.header
    assert isinstance(result, messages.Result)
    if awaited is None:
        return None  # the state drops it: a late, duplicate or unknown reply
    chunk, job = awaited.chunk, awaited.job
    if (result.start, result.count) != (chunk.start, chunk.count):
        return Problem(
            f"answers items {result.start}+{result.count}, not {chunk.start}+{chunk.count}"
        )
    return answer_problem(message, job.output_shape, job.softmax)


def answer_problem(
    message: Message, expected: tuple[int, ...] | None, softmax: bool
) -> Problem | None:
    """Why a RESULT's answer is not one its model can give: a well-formed list of failed
    items (the client relies on it), float32 outputs of the model's shape (``expected``,
    from the net itself), one row per item, times that are times, then the values: finite
    where the item did not fail (a worker fails images it cannot feed, non-finite pixels
    included, so non-finite outputs are its engine's doing) and, for probabilities
    (``softmax``), within 0..1."""
    result = message.header
    assert isinstance(result, messages.Result)
    try:
        failures = message.failures()  # decoded here only: the frame is forwarded untouched
    except ProtocolError as exc:
        return Problem(str(exc))
    if result.dtype != "float32":
        return Problem(f"outputs are {result.dtype}, not float32")
    shape = tuple(result.item_shape)
    if expected is not None and shape != expected:
        return Problem(f"output shape {shape}, the model's is {expected}")
    for key in TIMINGS:
        value = result.timings.get(key, 0.0)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return Problem(f"{key} time {value!r} is not a time")
    if "compute" not in result.timings:
        return Problem("no compute time")
    try:
        values = message.array("float32", shape)
    except ValueError:
        return Problem(
            f"outputs of {protocol.payload_bytes(message.payload)} bytes are not rows of {shape}"
        )
    if len(values) != result.count:
        return Problem(f"{len(values)} rows of outputs for {result.count} items")
    if result.rerun + result.failed > result.count:
        return Problem(
            f"{result.rerun} items re-run in f32 and {result.failed} failed, of {result.count}"
        )
    return values_problem(values, failures, softmax)


#: How far probabilities may stray outside 0..1 (rounding in reduced precisions).
PROBABILITY_SLACK = 1e-2


def values_problem(
    values: np.ndarray, failures: Sequence[tuple[int, int, str]], softmax: bool
) -> Problem | None:
    """Non-finite outputs of items that did not fail, or probabilities outside 0..1."""
    if failures:  # failed items' rows are NaN by design: look at the others
        keep = np.ones(len(values), bool)
        for offset, count, _ in failures:
            keep[offset : offset + count] = False
        values = values[keep]
    if not values.size:
        return None
    total = float(np.add.reduce(values, axis=None))  # float32: inf only if one is, or overflow
    if not math.isfinite(total) and not np.isfinite(values).all():
        bad = int(np.count_nonzero(~np.isfinite(values).reshape(len(values), -1).all(axis=1)))
        return Problem(f"{bad} of {len(values)} items have non-finite outputs", in_values=True)
    if softmax:
        low, high = float(values.min()), float(values.max())
        if low < -PROBABILITY_SLACK or high > 1 + PROBABILITY_SLACK:
            return Problem(
                f"probabilities range over {low:.3g}..{high:.3g}, outside 0..1", in_values=True
            )
    return None


# ------------------------------------------------------------------------ messages out


def message_of(instruction: ev.Instruction) -> tuple[bytes, Header, Sequence[Any]]:
    """What one instruction sends: to whom, its header and its payload frames."""
    match instruction:
        case ev.SendNeed(client=client, job=job, chunk=chunk, start=start, count=count):
            return client, messages.Need(job=job, chunk=chunk, start=start, count=count), ()
        case ev.SendTask():
            return instruction.worker, task_header(instruction), instruction.payload
        case ev.SendResult():
            return (instruction.client, result_header(instruction), instruction.result.payload)
        case ev.SendFailed(
            client=client, job=job, chunk=chunk, start=start, count=count, error=error
        ):
            return (
                client,
                messages.Failed(job=job, chunk=chunk, start=start, count=count, error=error),
                (),
            )
        case ev.SendDone(client=client, job=job, summary=summary):
            return client, messages.Done(job=job), protocol.document_frames(summary)
        case ev.SendCancel(peer=peer, job=job, reason=reason, summary=summary, chunk=chunk):
            return (
                peer,
                messages.Cancel(job=job, reason=reason, chunk=chunk),
                protocol.document_frames(summary) if summary is not None else (),
            )
        case ev.SendError(
            peer=peer, error=error, job=job, unknown_job=unknown_job, resubmit=resubmit
        ):
            return (
                peer,
                messages.Error(error=error, job=job, unknown_job=unknown_job, resubmit=resubmit),
                (),
            )
        case ev.DropWorker(worker=worker):
            return worker, messages.Disconnect(), ()
    raise TypeError(f"not an instruction: {instruction!r}")


def task_header(task: ev.SendTask) -> messages.Task:
    return messages.Task(
        job=task.job,
        chunk=task.chunk,
        attempt=task.attempt,
        start=task.start,
        count=task.count,
        model=task.model,
        digest=task.digest,
        dtype=task.dtype,
        item_shape=task.item_shape,
        engine=task.engine,
        stored=task.stored,
        place=task.place,
        exif_rotate=task.exif_rotate,
    )


def result_header(forward: ev.SendResult) -> messages.Result:
    """The worker's RESULT header as the client gets it: with the worker's name, the attempt
    and the chunk's trace."""
    header = forward.result.header
    assert isinstance(header, messages.Result)
    return msgspec.structs.replace(
        header,
        worker=forward.worker,
        attempt=forward.attempt,
        trace=forward.trace,
        kept=header.kept or forward.kept,
        corrects=forward.corrects,
    )


def frames(header: Header, payload: Sequence[Any] = ()) -> list[Any]:
    """The frames of one message from the broker; an error text (it may quote the peer) is
    cut to ``MAX_ERROR_CHARS``."""
    error = getattr(header, "error", None)
    if isinstance(error, str) and len(error) > MAX_ERROR_CHARS:
        header = msgspec.structs.replace(header, error=error[: MAX_ERROR_CHARS - 3] + "...")
    return protocol.encode(protocol.command_of(header), header, payload)
