"""One job from the command line (submit, run): a progress bar, outputs written as they
arrive, the summary, and an exit status that says whether every image came back."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import click
import numpy as np

from farm import defaults
from farm.client.client import FarmError, FarmTimeout, NoWorker, ResumeRefused

if TYPE_CHECKING:
    from farm.client.answers import AnswerSink, ModelCard
    from farm.client.client import Client, JobResult
    from farm.client.inputs import Source
    from farm.client.journal import Journaled, JournalHeader, JournalSink
    from farm.modelrepo.repository import ModelSpec
    from farm.startup import Timeline

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


@dataclass(frozen=True)
class Answers:
    """``--top-k``: answers (named classes and probabilities) rather than raw scores."""

    k: int
    card: ModelCard | None = None  # None: ask the broker for the model's labels


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
    job's first ones, scored against ``labels`` when given), its verdicts on stderr; any
    other value as it is, with no line.  ``spec``: the model's files here (None: not here,
    which ``auto`` refuses)."""
    if precision != "auto":
        if validate or min_agreement != defaults.MIN_AGREEMENT:
            raise click.UsageError("--validate and --min-agreement go with --precision auto")
        return precision, None
    if spec is None:
        raise click.ClickException(
            "--precision auto runs the model here to check each precision: its files must be "
            "in a --models-dir or $FARM_MODELS folder"
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
        raise click.ClickException(f"--precision auto: {exc}") from exc
    if source.dtype == "float32":  # image files and uint8 arrays reach the graph as uint8
        gate.refuse("int8", "the job's images are float32: int8 runs on uint8 images")
    for line in gate.lines():
        click.echo(line, err=True)
    best = gate.passed
    summary = f"precision auto: {best[0].describe()}" if best else None
    return gate.precision, summary or "precision auto: f32, no lower precision passed the gate"


def answers_wanted(
    source: Source, out: str | None, top_k: int | None, card: ModelCard | None
) -> Answers | None:
    """Whether a job writes answers: with --top-k, with a .csv/.jsonl --out, or for image
    files with no --out (named on the terminal)."""
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
    return Answers(top_k or (DEFAULT_TOP_K if to_file else 1), card)


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
def cancel_on_interrupt(
    client: Client, on_interrupt: Callable[[], None] = lambda: None
) -> Iterator[list[bool]]:
    """The first Ctrl-C calls ``on_interrupt`` and cancels the job (the broker confirms what
    finished); a second one quits at once.  Yields a list that holds True once Ctrl-C was
    pressed."""
    pressed: list[bool] = []

    def interrupted(*_: Any) -> None:
        if pressed:
            click.echo("\nquit without waiting for the broker", err=True)
            raise SystemExit(130)
        pressed.append(True)
        click.echo("\ncancelling the job; Ctrl-C again to quit at once", err=True)
        on_interrupt()
        client.cancel()

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


class Refused(click.ClickException):
    """An error that exits with status 2: the command was refused, nothing was run."""

    exit_code = 2


def check_journal(out: str, resume: bool) -> None:
    """Refuse to overwrite an unfinished job's outputs (``OUT.partial`` of a killed job, or
    ``OUT`` of one that stopped early) without ``--resume``; with it and no journal, say
    that the job starts afresh."""
    from farm.client.journal import journal_path
    from farm.client.npy import partial_path

    journal = journal_path(out)
    if journal.exists() and not resume:
        partial = partial_path(out)
        held = (
            f"{partial} holds its outputs so far"
            if partial.exists()
            else f"{out} lacks the images that did not come back"
        )
        raise Refused(
            f"{journal} is there: the job writing {out} did not finish ({held}); "
            f"add --resume to finish that job, or delete {journal} to start afresh"
        )
    if resume and not journal.exists():
        click.echo(f"--resume: no journal at {journal}: starting afresh", err=True)


def run_job(
    broker: BrokerAccess,
    source: Source,
    model: str,
    out: str | None = None,
    quiet: bool = False,
    trace: str | None = None,
    journal: bool = False,
    resume: bool = False,
    answers: Answers | None = None,
    nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    timeline: Timeline | None = None,
    notes: tuple[str, ...] = (),
    inputs: tuple[str, ...] = (),
    **job_options: Any,
) -> np.ndarray | None:
    """Submit with a progress bar, write outputs as they come, print the summary.

    ``out`` is written as ``OUT.partial``, renamed to ``out`` when the job ends with every
    row written (or NaN-filled, or a row with the reason): a killed client leaves no
    ``out`` that reads as complete, and an earlier job's ``out`` stays until then.  It is
    refused if it, or a file written beside it, is one of the job's input files (or of
    ``inputs``: the command's arguments, list files included), and while another job
    writes it (``OUT.lock``).  ``journal``: keep ``OUT.journal`` beside ``out``
    (``farm.client.journal``) so that a killed or interrupted job can be finished with
    ``resume``; Ctrl-C then leaves ``OUT.partial``, as a kill does.  ``answers``: write
    each image's top classes (to ``out``, a .csv or .jsonl, else the terminal) instead of
    raw scores.  ``nan_shape``: gives one output's shape (asked only if no result came),
    so that a `.npy` ``out`` of a job whose every image failed is written too (NaN rows;
    without it, none).  ``timeline``: marked when the job is submitted, and at its first
    and last result.  ``notes``: lines the summary ends with (the precision gate's
    choice).  ``job_options``: ``Client.run``'s priority, job_timeout, algo, params,
    backend and precision.  Returns the raw outputs when they were kept: in memory, or
    memory-mapped from ``out``.
    """
    journal = journal and out is not None
    if resume and not journal:
        raise click.UsageError("--resume needs --out: the outputs of the job to resume")
    with contextlib.ExitStack() as held:
        if out:
            held.enter_context(guarded_output(out, source, inputs, resume if journal else None))
        result, output, interrupted = submit_job(
            broker,
            source,
            model,
            out,
            quiet,
            trace,
            journal,
            answers,
            nan_shape,
            timeline,
            job_options,
        )
        if timeline is not None:
            timeline.mark("job ended")
        outputs = result.outputs
        written = output.written or outputs is not None  # a journaled .npy: mapped if written
        if outputs is None and out and written and answers is None:
            outputs = np.load(out, mmap_mode="r")
        echo_result(
            result,
            out,
            outputs,
            trace,
            journaled=journal,
            answers=answers is not None,
            written=written,
        )
        for note in notes:
            click.echo(note, err=True)
        exit_if_incomplete(
            result,
            len(source),
            interrupted,
            source,
            answers is not None,
            written,
            held=out if output.held else None,
        )
    return outputs


def check_output(
    out: str, source: Source, inputs: tuple[str, ...] = (), resume: bool | None = None
) -> None:
    """Refuse ``out`` (Refused, exit status 2) before anything is written: an input file
    among the files written there, another job writing it, or (``resume`` False: a
    journaled output without ``--resume``) an unfinished job's journal.  A look, held by
    nothing: ``guarded_output`` checks again and holds the lock for the job."""
    from farm.client.journal import OutputBusy, check_free

    refuse_input(out, source, inputs)
    try:
        check_free(out)
    except OutputBusy as exc:
        raise Refused(str(exc)) from exc
    if resume is False:
        check_journal(out, resume)


def refuse_input(out: str, source: Source, inputs: tuple[str, ...]) -> None:
    """Refused if ``out``, or a file written beside it, is one of the job's inputs (its
    files, or the list files named on the command line); ClickException if ``out``'s
    folder cannot be written."""
    from farm.client.journal import OutputIsInput, check_not_input

    writable(out)
    try:
        check_not_input(out, source, [arg for arg in inputs if os.path.isfile(arg)])
    except OutputIsInput as exc:
        raise Refused(str(exc)) from exc


def writable(out: str) -> None:
    """ClickException unless ``out``'s folder is there and writable."""
    if not os.access(Path(out).resolve().parent, os.W_OK):
        raise click.ClickException(
            f"cannot write {out}: its folder does not exist or is not writable"
        )


@contextlib.contextmanager
def guarded_output(
    out: str, source: Source, inputs: tuple[str, ...] = (), resume: bool | None = None
) -> Iterator[None]:
    """``out`` checked (``refuse_input``) and locked while the job writes it: Refused (exit
    status 2), nothing written, if it is an input or another job holds it.  ``resume`` (a
    journaled output): ``check_journal`` then."""
    from farm.client.journal import OutputBusy, output_lock

    refuse_input(out, source, inputs)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(output_lock(out))
        except OutputBusy as exc:
            raise Refused(str(exc)) from exc
        if resume is not None:
            check_journal(out, resume)
        yield


def submit_job(
    broker: BrokerAccess,
    source: Source,
    model: str,
    out: str | None,
    quiet: bool,
    trace: str | None,
    journal: bool,
    answers: Answers | None,
    nan_shape: Callable[[], tuple[int, ...] | None] | None,
    timeline: Timeline | None,
    job_options: dict[str, Any],
) -> tuple[JobResult, JobOutput, bool]:
    """Run the job (``run_job``'s arguments) with its progress shown: its result, its
    output, and whether Ctrl-C stopped it.  ClickException for what stopped it early."""
    from farm.client.client import job_engine

    try:
        with broker.connect() as client, contextlib.ExitStack() as stack:
            output = stack.enter_context(
                job_sink(
                    client,
                    source,
                    model,
                    out,
                    journal,
                    answers,
                    nan_shape,
                    job_engine(job_options.get("backend"), job_options.get("precision")),
                    job_options.get("exif_rotate", True),
                )
            )
            bar = stack.enter_context(progress_display(len(source), model, quiet))
            interrupted = stack.enter_context(cancel_on_interrupt(client, output.hold))
            progress = bar.update if timeline is None else marking_first(bar.update, timeline)
            if timeline is not None:
                timeline.mark("job submitted")
            result = client.run(
                source,
                model,
                progress=progress,
                trace=trace is not None,
                notice=lambda line: bar.write(line, file=sys.stderr),
                **output.arguments,
                **job_options,
            )
    except NoWorker as exc:
        raise click.ClickException(str(exc)) from exc
    except FarmTimeout as exc:
        raise click.ClickException(f"{exc} ({NO_BROKER_HINT})") from exc
    except ResumeRefused as exc:
        raise Refused(str(exc)) from exc
    except (FarmError, OSError, ValueError) as exc:
        raise click.ClickException(with_resume_hint(str(exc), out, journal)) from exc
    return result, output, bool(interrupted)


def with_resume_hint(error: str, out: str | None, journal: bool) -> str:
    """An error that stopped a journaled job, and how to finish that job once it is fixed
    (when its journal is there: some outputs were written)."""
    from farm.client.journal import journal_path

    if not (out and journal and journal_path(out).exists()) or "--resume" in error:
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


@dataclass
class JobOutput:
    """``Client.run``'s output argument, and whether the job wrote ``out`` (its ``.partial``
    file renamed to it)."""

    arguments: dict[str, Any]
    written: bool = False
    journaled: Journaled | None = None  # a journaled file: Ctrl-C leaves it to --resume

    def hold(self) -> None:
        """Ctrl-C: leave a journaled output unfinished (``OUT.partial`` and its journal),
        as a killed job does, for ``--resume`` to finish."""
        if self.journaled is not None:
            self.journaled.hold = True

    @property
    def held(self) -> bool:
        """Whether the job ended held, its output not renamed to ``out``."""
        return self.journaled is not None and self.journaled.hold and not self.journaled.published


@contextlib.contextmanager
def job_sink(
    client: Client,
    source: Source,
    model: str,
    out: str | None,
    journal: bool,
    answers: Answers | None,
    nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
    engine: tuple[str, str] | None = None,
    exif_rotate: bool = True,
) -> Iterator[JobOutput]:
    """``Client.run``'s output argument: answers (journaled, to a file, or on the terminal),
    a journaled `.npy`, a plain `.npy`, or memory.  A file is written as ``OUT.partial``
    and renamed to ``out`` once the job has written its every row (journaled: by
    ``Client.run``); whatever it opens is closed after the job."""
    from farm.client.answers import AnswerSink, open_writer
    from farm.client.client import ArraySink
    from farm.client.journal import Journaled, JournalHeader
    from farm.client.npy import NpyWriter, partial_path, publish

    partial = partial_path(out) if out else None

    def job() -> JournalHeader:  # the input is hashed only for a journal
        return JournalHeader.of_job(model, source, engine, exif_rotate)

    if answers is not None:
        card = answers.card or client.model_card(model)
        k, cut = card.top_k(answers.k)
        if cut:
            click.echo(cut, err=True)
        sink = (
            answers_journal(out, job(), k, card, source.names)
            if out and journal
            else AnswerSink(k, card, open_writer(out, card, k, partial), source.names)
        )
        output = JobOutput({"out": sink}, journaled=sink if isinstance(sink, Journaled) else None)
        try:
            yield output
        finally:
            sink.close()
        output.written = isinstance(sink, Journaled) and sink.published
        if out and partial and not journal and sink.next_row == len(source):
            publish(partial, Path(out))
            output.written = True
    elif out and journal:
        journaled = npy_journal(out, job(), nan_shape)
        output = JobOutput({"out": journaled}, journaled=journaled)
        try:
            yield output  # Client.run renames it, unless held
        finally:
            journaled.close()
        output.written = journaled.published
    elif out and partial:
        npy = NpyWriter(partial, len(source), nan_shape)
        output = JobOutput({"out": npy})
        try:
            yield output
        finally:
            npy.close()
        if npy.item_shape is not None:  # else no row was written, nor filled: no file
            publish(partial, Path(out))
            output.written = True
    else:
        yield JobOutput({"out": ArraySink(len(source))})


def answers_journal(
    out: str,
    job: JournalHeader,
    k: int,
    card: ModelCard,
    names: Callable[[int, int], Sequence[str]],
) -> AnswerSink:
    """A journaled answers file (``farm.client.answerjournal``) of ``job``, resumed if its
    journal is there; ResumeRefused if that journal is another job's."""
    from farm.client.answerjournal import AnswersJournal
    from farm.client.answers import answers_format
    from farm.client.journal import JournalMismatch

    header = dataclasses.replace(job, format=answers_format(out), top_k=k)
    try:
        return AnswersJournal.open(out, header, card, names)
    except JournalMismatch as exc:
        raise ResumeRefused(str(exc)) from exc


def npy_journal(
    out: str,
    header: JournalHeader,
    nan_shape: Callable[[], tuple[int, ...] | None] | None = None,
) -> JournalSink:
    """A journaled `.npy` output (``farm.client.journal``) of the job ``header`` describes,
    resumed if its journal is there; ResumeRefused if that journal is another job's."""
    from farm.client.journal import JournalMismatch, JournalSink

    try:
        return JournalSink.open(out, header, nan_shape)
    except JournalMismatch as exc:
        raise ResumeRefused(str(exc)) from exc


def echo_result(
    result: JobResult,
    out: str | None,
    outputs: np.ndarray | None,
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
    if result.shared:
        click.echo(
            f"the workers read the images from shared storage: {result.input_bytes:,} bytes "
            f"said where they lie"
        )
    if out and answers and written:
        answered = plural(result.summary.items + result.resumed, "image")
        click.echo(f"answers for {answered} written to {out}")
    elif out and outputs is not None:
        click.echo(f"outputs {outputs.shape} {outputs.dtype} written to {out}")
    if out and journaled and journal_path(out).exists():
        click.echo(
            f"journal kept at {journal_path(out)}: --resume submits the images still missing"
        )
    if trace and result.trace is not None:
        click.echo(
            f"trace of {len(result.trace.chunks)} chunks written to {trace} "
            f"(farm report {trace} -o {Path(trace).with_suffix('.png')})"
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
