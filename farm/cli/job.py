"""One job from the command line (submit, run): its options made an ``OutputSpec``, a
progress bar, the summary, and an exit status that says whether every image came back.
``Client.run`` opens, guards and writes the outputs (``farm.client.outputs``); this maps
what it raises to messages and exit statuses."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import click
import numpy as np

from farm import defaults
from farm.client.errors import FarmError, FarmTimeout, NoWorker, OutputRefused, ResumeRefused
from farm.client.outputs import OutputSpec
from farm.wire.engines import CASCADES

if TYPE_CHECKING:
    from farm.client.answers import ModelCard
    from farm.client.client import Client, JobResult
    from farm.client.inputs import Source
    from farm.engines.gate import Gate
    from farm.modelrepo.repository import ModelSpec
    from farm.startup import Timeline
    from farm.summary import JobSummary

NO_BROKER_HINT = (
    "is a broker running there? --broker or FARM_BROKER give its address, `farm up` "
    "starts a local farm that commands find by themselves; a broker started with --curve "
    "needs --curve here too"
)


@dataclass(frozen=True, kw_only=True)
class BrokerAccess:
    """How a command reaches its broker: where, with which keys, and how long it waits."""

    endpoint: str | None  # None: found (``farm.runtime.choose_broker``)
    timeout: float = defaults.CLIENT_TIMEOUT  # seconds of broker silence before giving up
    curve: str | None = None
    curve_name: str = defaults.CLIENT_KEY

    def connect(self) -> Client:
        from farm.client.client import Client

        client = Client(
            self.endpoint, timeout=self.timeout, curve=self.curve, curve_name=self.curve_name
        )
        if client.broker_choice.found == "local farm":
            click.echo(f"using the local farm of `farm up` at {client.broker}", err=True)
        return client


def load_input(arguments: tuple[str, ...]) -> Source:
    """A job's input: one `.npy` file (read range by range: inputs of any size, read as
    needed), or image files named by files, folders, globs and lists.  Its notices (an
    array converted to float32, files skipped) go to stderr, one line each."""
    from farm.client.inputs import InputError, open_input

    try:
        source = open_input(arguments)
    except InputError as exc:
        raise click.ClickException(str(exc)) from exc
    for notice in source.notices:
        click.echo(notice, err=True)
    return source


def gated_precision(
    precision: str | None,
    spec: ModelSpec | None,
    source: Source,
    validate: tuple[str, ...],
    min_agreement: float,
    backend: str | None = None,
    labels: np.ndarray | None = None,
    exif_rotate: bool = True,
) -> tuple[str | None, str | None]:
    """The precision a job asks for, and the line its summary ends with: ``auto``
    resolved by the precision gate on ``backend`` with the ``--validate`` images (else the
    job's first ones, scored against ``labels`` when given), its verdicts on stderr; a
    cascade (``bf16+f32``) likewise, run with the margin fitted there whatever its
    agreement; any other value as it is, with no line (``bf16+f32=0.4``: that margin, on
    the named ``--backend``, on any device that offers bf16).  ``spec``: the model's files
    here (None: not here, which ``auto`` and a cascade refuse)."""
    fitted = precision in CASCADES
    if precision != "auto" and not fitted:
        if validate or min_agreement != defaults.MIN_AGREEMENT:
            raise click.UsageError("--validate and --min-agreement go with auto or a cascade")
        return precision, None
    if spec is None:
        raise click.ClickException(
            f"--precision {precision} runs the model here to check each precision: put its "
            f"files in a --models-dir or $FARM_MODELS folder"
        )
    from farm.client.inputs import InputError
    from farm.client.samples import first_images, input_key
    from farm.engines.gate import judge_input
    from farm.modelrepo.repository import ModelError

    count = defaults.VALIDATION_IMAGES
    validation = load_input(validate) if validate else source
    label = " ".join(validate) if validate else "the job's first images"
    labels = None if validate or labels is None else labels[:count]

    def decoded() -> tuple[np.ndarray, np.ndarray | None]:
        sample = first_images(validation, spec, count, label, exif_rotate)
        click.echo(f"validation: {sample.describe()}", err=True)
        kept = None if labels is None else labels[sample.kept]
        return sample.images, kept

    try:
        key = input_key(validation, count, labels, exif_rotate)
        gate = judge_input(spec, key, decoded, min_agreement / 100, backend or "auto")
    except (InputError, ModelError, OSError) as exc:
        raise click.ClickException(f"--precision {precision}: {exc}") from exc
    if source.dtype == "float32":  # image files and uint8 arrays reach the graph as uint8
        gate.refuse("int8", "the job's images are float32: int8 runs on uint8 images")
    for line in gate.lines():
        click.echo(line, err=True)
    if fitted and precision is not None:
        return chosen_cascade(gate, precision)
    best = gate.passed
    summary = f"precision auto: {best[0].describe()}" if best else None
    return gate.precision, summary or "precision auto: f32, no lower precision passed the gate"


def chosen_cascade(gate: Gate, cascade: str) -> tuple[str, str]:
    """``--precision bf16+f32``: the cascade with the margin the gate fitted, on the
    gate's backend (f32 on a worker that cannot run it); ClickException where it was not
    tried."""
    from farm.wire.engines import CALIBRATION_PREFIX, EngineChoice

    verdict = gate.verdict(cascade)
    if verdict is None or verdict.problem is not None or verdict.margin is None:
        reason = verdict.problem if verdict is not None else "not a candidate here"
        raise click.ClickException(f"--precision {cascade}: {reason}")
    int8 = cascade.startswith("int8") and gate.calibration
    version = gate.calibration[:CALIBRATION_PREFIX] if int8 and gate.calibration else None
    choice = EngineChoice("auto", (cascade, "f32"), gate.backend, version, (verdict.margin,))
    return choice.precision_text(), f"precision {cascade}: {verdict.describe()}"


def answers_wanted(source: Source, out: str | None, top_k: int | None) -> int | None:
    """Classes per answer, when a job writes answers: with --top-k, with a .csv/.jsonl
    --out, or for image files with no --out (named on the terminal); None: raw outputs."""
    from farm.client.answers import DEFAULT_TOP_K, FORMATS
    from farm.client.inputs import FileSource

    to_file = out is not None and Path(out).suffix.lower() in FORMATS
    if out is not None and not to_file and not out.lower().endswith(".npy"):
        raise click.UsageError(
            f"--out {out}: write raw scores as .npy, or answers as .csv or .jsonl"
        )
    if top_k is None and not to_file and not (out is None and isinstance(source, FileSource)):
        return None
    if top_k is not None and out is not None and not to_file:
        raise click.UsageError(
            "--top-k writes answers: give --out a .csv or .jsonl file (or no --out: the terminal)"
        )
    return top_k or (DEFAULT_TOP_K if to_file else 1)


def output_spec(
    source: Source,
    out: str | None,
    top_k: int | None,
    card: ModelCard | None,
    resume: bool = False,
    inputs: tuple[str, ...] = (),
    nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
) -> OutputSpec | None:
    """The job's outputs as --out, --top-k and --resume ask (None: kept in memory): a
    journaled file, or answers on the terminal; its file refused now (``refuse_output``),
    before a farm starts or the precision gate runs.  ``card``: the labels naming answers
    (None: the broker's); ``inputs``: the command's arguments (list files: never written);
    ``nan_shape``: one output's shape, for a `.npy` of a job whose every image failed."""
    k = answers_wanted(source, out, top_k)
    if resume and out is None:
        raise click.UsageError("--resume needs --out: the outputs of the job to resume")
    if out is None and k is None:
        return None
    output = OutputSpec(
        path=out, top_k=k, card=card, resume=resume, inputs=inputs, nan_shape=nan_shape
    )
    refuse_output(output, source)
    return output


def refuse_output(output: OutputSpec, source: Source) -> None:
    """A look at the output file before anything runs (``check_outputs``): Refused (exit
    status 2) if it is an input, another job's, or an unfinished job's without --resume;
    ClickException if its folder cannot be written."""
    from farm.client.outputs import check_outputs

    try:
        check_outputs(output, source)
    except OutputRefused as exc:
        raise Refused(str(exc)) from exc
    except FarmError as exc:
        raise click.ClickException(str(exc)) from exc


def warn_unkept(source: Source, out: str | None, top_k: int | None) -> None:
    """Say, before the job, when its outputs would go nowhere: an array's (a .npy) with no
    --out nor --top-k (image files print their answers then)."""
    from farm.client.inputs import ArraySource

    if out is None and top_k is None and isinstance(source, ArraySource):
        click.echo(
            f"{source.label}: no --out, so the outputs are not kept (only the summary is "
            f"shown): add --out scores.npy to write them, or --top-k 1 to print each "
            f"image's top class",
            err=True,
        )


def output_shape(spec: ModelSpec) -> tuple[int, ...] | None:
    """One output's shape as the model's prototxt gives it (None if it cannot be read):
    ``run_job``'s ``nan_shape``."""
    from farm.modelrepo.caffe_net import Network, NetworkError

    try:
        net = Network.load(spec.prototxt, input_shape=spec.declared_input)
    except NetworkError:
        return None
    return tuple(net.shapes[spec.output][1:])


@contextlib.contextmanager
def cancel_on_interrupt(client: Client) -> Iterator[list[bool]]:
    """The first Ctrl-C cancels the job (the broker confirms what finished), leaving a
    journaled output unfinished for --resume, as a kill does; a second one quits at once.
    Yields a list that holds True once Ctrl-C was pressed."""
    pressed: list[bool] = []

    def interrupted(*_: Any) -> None:
        if pressed:
            click.echo("\nquit without waiting for the broker", err=True)
            raise SystemExit(130)
        pressed.append(True)
        click.echo("\ncancelling the job; Ctrl-C again to quit at once", err=True)
        client.cancel(hold=True)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


class Refused(click.ClickException):
    """An error that exits with status 2: the command was refused, nothing was run."""

    exit_code = 2


def run_job(
    broker: BrokerAccess,
    source: Source,
    model: str,
    output: OutputSpec | None = None,
    quiet: bool = False,
    trace: str | None = None,
    timeline: Timeline | None = None,
    notes: tuple[str, ...] = (),
    **job_options: Any,
) -> np.ndarray | None:
    """Submit with a progress bar, print the summary; exit 1 or 130 if images are missing.

    ``output``: where ``Client.run`` writes the outputs (``farm.client.outputs``; None:
    memory).  ``timeline``: marked when the job is submitted, and at its first and last
    result.  ``notes``: lines the summary ends with (the precision gate's choice).
    ``job_options``: ``Client.run``'s priority, job_timeout, algo, params, backend,
    precision...  Returns the raw outputs when they were kept: in memory, or
    memory-mapped from the file written.
    """
    result, interrupted = submit_job(
        broker, source, model, output, quiet, trace, timeline, job_options
    )
    if timeline is not None:
        timeline.mark("job ended")
    path = output.path if output is not None else None
    answers = output is not None and output.answers is not None
    written = result.written or result.outputs is not None
    echo_result(result, path, trace, bool(output and output.journaled), answers, written)
    for note in notes:
        click.echo(note, err=True)
    held = path if result.held else None
    exit_if_incomplete(result, len(source), interrupted, source, answers, written, held)
    return result.outputs


def submit_job(
    broker: BrokerAccess,
    source: Source,
    model: str,
    output: OutputSpec | None,
    quiet: bool,
    trace: str | None,
    timeline: Timeline | None,
    job_options: dict[str, Any],
) -> tuple[JobResult, bool]:
    """Run the job (``run_job``'s arguments) with its progress shown: its result, and
    whether Ctrl-C stopped it.  ClickException for what stopped it early."""
    try:
        with broker.connect() as client, contextlib.ExitStack() as stack:
            bar = stack.enter_context(progress_display(len(source), model, quiet))
            interrupted = stack.enter_context(cancel_on_interrupt(client))
            progress = bar.update if timeline is None else marking_first(bar.update, timeline)
            if timeline is not None:
                timeline.mark("job submitted")
            result = client.run(
                source,
                model,
                output,
                progress=progress,
                trace=trace is not None,
                notice=lambda line: bar.write(line, file=sys.stderr),
                **job_options,
            )
    except (FarmError, OSError, ValueError) as exc:
        raise job_error(exc, output) from exc
    return result, bool(interrupted)


def job_error(error: Exception, output: OutputSpec | None) -> click.ClickException:
    """What to say, and the exit status, for an error that stopped a job: Refused (2) for
    an output or a resume refused before anything ran, else 1."""
    if isinstance(error, NoWorker):
        return click.ClickException(str(error))
    if isinstance(error, FarmTimeout):
        return click.ClickException(f"{error} ({NO_BROKER_HINT})")
    if isinstance(error, (ResumeRefused, OutputRefused)):
        return Refused(str(error))
    return click.ClickException(with_resume_hint(str(error), output))


def with_resume_hint(error: str, output: OutputSpec | None) -> str:
    """An error that stopped a journaled job, and how to finish that job once it is fixed
    (when its journal is there: some outputs were written)."""
    from farm.client.journal import journal_path

    out = output.path if output is not None and output.journaled else None
    if not (out and journal_path(out).exists()) or "--resume" in error:
        return error
    return (
        f"{error}\n(the outputs written so far are kept, with {journal_path(out)}: once "
        f"that is fixed, the same command with --resume submits only the images missing)"
    )


def marking_first(progress: Callable[[int], Any], timeline: Timeline) -> Callable[[int], Any]:
    """``progress``, marking ``first result`` on the timeline at its first call."""

    def update(count: int) -> Any:
        if "first result" not in timeline.stamps:
            timeline.mark("first result")
        return progress(count)

    return update


#: Seconds between the plain progress lines written where stderr is not a terminal.
PROGRESS_LINE_SECONDS = 10.0


class ProgressDisplay(Protocol):
    """A job's progress on stderr: a bar (tqdm) or plain lines."""

    def update(self, n: float = 1) -> None: ...

    def write(self, line: str, file: IO[str] | None = None) -> None: ...


@dataclass
class PlainProgress:
    """Progress where stderr is not a terminal (a log file, a pipe): a line when the first
    images come back (or are resumed), then one every ``period`` seconds with the rate
    since the line before, and no carriage return:
    ``lenet: 12,000/40,000 images (30%), 24,000 images/s``."""

    total: int
    name: str
    period: float = PROGRESS_LINE_SECONDS
    done: int = 0
    shown: tuple[float, int] | None = None  # when the last line was written, and its count

    def update(self, n: float = 1) -> None:
        self.done += int(n)
        now = time.monotonic()
        if self.shown is None:
            click.echo(self.line(), err=True)
        elif now - self.shown[0] >= self.period:
            click.echo(self.line((self.done - self.shown[1]) / (now - self.shown[0])), err=True)
        else:
            return
        self.shown = (now, self.done)

    def line(self, rate: float | None = None) -> str:
        """The line for the count so far, and the rate since the last line (if any)."""
        from farm.summary import per_second, plural

        return (
            f"{self.name}: {self.done:,}/{plural(self.total, 'image')} "
            f"({self.done / max(1, self.total):.0%})"
            + ("" if rate is None else f", {per_second(rate)}")
        )

    def write(self, line: str, file: IO[str] | None = None) -> None:
        click.echo(line, file=file or sys.stderr)


@contextlib.contextmanager
def progress_display(total: int, name: str, quiet: bool) -> Iterator[ProgressDisplay]:
    """A progress bar on a terminal; elsewhere (stderr redirected) ``PlainProgress``'s
    lines; nothing with ``quiet``."""
    if quiet or sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, unit="img", disable=quiet, file=sys.stderr, desc=name) as bar:
            yield bar
    else:
        yield PlainProgress(total, name)


def echo_result(
    result: JobResult,
    out: str | None,
    trace: str | None,
    journaled: bool = False,
    answers: bool = False,
    written: bool = True,
) -> None:
    """Save the trace; say how the job went, what came from the journal, and where its
    outputs (``written``: whether ``out`` was), journal and trace are."""
    from farm.client.journal import journal_path
    from farm.client.trace import save_trace
    from farm.summary import plural

    if trace and result.trace is not None:
        save_trace(result.trace, trace)
    if result.summary.total or not result.resumed:
        click.echo(result.summary.format())
        for line in trust_lines(result.summary):
            click.echo(line)
    if result.resumed:
        click.echo(
            f"{plural(result.resumed, 'image')} resumed from {journal_path(out or '')} "
            f"(checked against the outputs); {result.summary.total:,} submitted"
        )
    if result.resubmissions:
        click.echo(
            f"the broker was lost and the missing images submitted again "
            f"({plural(result.resubmissions, 'time')})"
        )
    if result.kept:
        click.echo(
            f"{plural(result.kept, 'image')} came back from results the workers kept across a lost "
            f"broker, worker or client: not computed again"
        )
    if result.oriented:
        click.echo(orientation_line(result.oriented, result.exif_rotate))
    if result.rerun:
        failed = sum(items.count for items in result.failed)
        click.echo(rerun_line(result.rerun, result.summary.items - failed))
    if result.shared:
        click.echo(
            f"the workers read the images from shared storage: {result.input_bytes:,} bytes "
            f"said where they lie"
        )
    if out and answers and written:
        answered = plural(result.summary.items + result.resumed, "image")
        click.echo(f"answers for {answered} written to {out}")
    elif out and result.outputs is not None:
        click.echo(f"outputs {result.outputs.shape} {result.outputs.dtype} written to {out}")
    if out and journaled and journal_path(out).exists():
        click.echo(
            f"journal kept at {journal_path(out)}: --resume submits the images still missing"
        )
    if trace and result.trace is not None:
        click.echo(
            f"trace of {len(result.trace.chunks)} chunks written to {trace} "
            f"(farm report {trace} -o {Path(trace).with_suffix('.png')})"
        )


def trust_lines(summary: JobSummary) -> list[str]:
    """The summary's lines on answers the broker did not take on trust: refused, spot
    checked, corrected; workers quarantined; the job parked.  None on a normal job."""
    from farm.summary import plural

    lines = []
    if summary.bad_answers:
        others = "other workers" if summary.bad_answers > 1 else "another worker"
        lines.append(
            f"{plural(summary.bad_answers, 'answer')} failed the broker's checks and ran "
            f"again on {others}"
        )
    lines += [f"quarantined: {entry}" for entry in summary.quarantined]
    lines += spot_check_lines(summary)
    if summary.parked:
        lines.append(f"parked {plural(summary.parked, 'time')}: the client left a NEED unanswered")
    return lines


def spot_check_lines(summary: JobSummary) -> list[str]:
    """Images re-run on another device as spot checks (and their disagreements, those no
    third device settled, those no other device could check), and those re-run after a
    worker lost a check."""
    from farm.summary import plural

    lines = []
    if summary.verified:
        share = summary.verified / summary.total if summary.total else 0.0
        unresolved = f", {summary.unresolved:,} unresolved" if summary.unresolved else ""
        lines.append(
            f"verified {plural(summary.verified, 'image')} ({share:.1%}) on another device: "
            f"{plural(summary.disagreements, 'disagreement')}{unresolved}"
        )
    if summary.unverified:
        lines.append(
            f"unverified: {plural(summary.unverified, 'image')} sampled for a spot check "
            f"had no other device to run on"
        )
    if summary.corrected:
        lines.append(
            f"corrected: {plural(summary.corrected, 'image')} re-run after a worker lost a "
            f"spot check"
        )
    return lines


def rerun_line(rerun: int, computed: int) -> str:
    """A cascade's images run again in f32."""
    from farm.summary import plural

    return (
        f"cascade: {plural(rerun, 'image')} ({rerun / max(1, computed):.1%} of {computed:,}) "
        f"run again in f32, their fast answer in doubt"
    )


def orientation_line(oriented: int, rotated: bool) -> str:
    """The summary's line on image files with an EXIF orientation: turned, or not."""
    from farm.summary import plural

    if rotated:
        return (
            f"{plural(oriented, 'image')} turned upright by EXIF orientation, as photo "
            f"viewers do (--no-exif-rotate: the stored pixels)"
        )
    return f"{plural(oriented, 'image')} with an EXIF orientation ran as stored (--no-exif-rotate)"


def exit_if_incomplete(
    result: JobResult,
    total: int,
    interrupted: bool,
    source: Source | None = None,
    answers: bool = False,
    written: bool = True,
    held: str | None = None,
) -> None:
    """Exit 130 (Ctrl-C) or 1 (cancelled, timed out, failed images) when images are missing;
    failed image files are named.  ``written``: whether raw outputs were written (no file
    when no image came back and their shape was not known).  ``held``: the output a
    Ctrl-C left unfinished (``OUT.partial``, for ``--resume``)."""
    from farm.client.client import describe_failures
    from farm.client.npy import partial_path

    if result.cancelled:
        missing = sum(f.count for f in result.failed)
        if held is not None and partial_path(held).exists():
            rest = (
                f"{total - missing:,} of {total:,} images came back, kept in "
                f"{partial_path(held)}; the same command with --resume submits the other "
                f"{missing:,} ({held} is written once the job is finished)"
            )
        elif held is None and (answers or written):
            rest = (
                f"{total - missing:,} of {total:,} images came back, the other "
                f"{missing:,} {'have rows with the reason' if answers else 'have NaN outputs'}"
            )
        else:
            rest = f"no outputs were written: none of the {total:,} images came back"
        click.echo(f"job stopped: {result.cancelled}; {rest}", err=True)
        raise SystemExit(130 if interrupted else 1)
    if result.failed:
        from farm.client.inputs import FileSource

        names = source.names if isinstance(source, FileSource) else None  # files by path
        note = (
            ""
            if answers
            else "\n(their outputs are NaN)"
            if written
            else "\n(no outputs were written: no image came back)"
        )
        click.echo(describe_failures(result.failed, names) + note, err=True)
        raise SystemExit(1)
