"""A job's outputs, opened for ``Client.run``: in memory, a sink of the caller's, or a file
that an ``OutputSpec`` describes (raw outputs as `.npy`, answers as .csv or .jsonl), which
``farm submit --out`` and ``Client.run(out=...)`` write alike.

A file is refused before anything is written (``OutputRefused``) if it, or a file written
beside it, is one of the job's input files (``check_not_input``), or while another job
writes it (``OUT.lock``: ``output_lock``).  It is written as ``OUT.partial`` and renamed
to ``OUT`` once every row is there (written, NaN-filled, or a row with the reason).  A
journaled one keeps ``OUT.journal`` beside it (``farm.client.journal``,
``farm.client.answerjournal``) until the job is whole: ``resume`` finishes a killed job,
submitting only the items missing, and without it an unfinished job's journal is refused
rather than overwritten.  ``check_outputs`` is the same refusal as a look, held by
nothing, for a caller with work to do first (a precision gate, a farm to start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from farm.client.answerjournal import AnswersJournal
from farm.client.answers import (
    DEFAULT_TOP_K,
    FORMATS,
    AnswerSink,
    ModelCard,
    answers_format,
    open_writer,
)
from farm.client.errors import FarmError, OutputRefused, ResumeRefused
from farm.client.journal import (
    Journaled,
    JournalHeader,
    JournalMismatch,
    JournalSink,
    OutputBusy,
    OutputIsInput,
    check_free,
    check_not_input,
    journal_path,
    output_lock,
)
from farm.client.npy import NpyWriter, partial_path, publish

if TYPE_CHECKING:
    from farm.client.inputs import Source


class ResultSink(Protocol):
    """Where outputs go: ``write`` them by item index, ``fill`` failed items."""

    def write(self, start: int, values: np.ndarray) -> None: ...

    def fill(self, start: int, count: int, value: float) -> None: ...


@dataclass
class ArraySink:
    """Outputs kept in memory (``array`` is made with the first result unless given)."""

    total: int
    array: np.ndarray | None = None

    def write(self, start: int, values: np.ndarray) -> None:
        if self.array is None:
            self.array = np.empty((self.total, *values.shape[1:]), dtype=values.dtype)
        if values.shape[1:] != self.array.shape[1:]:
            raise FarmError(
                f"outputs of shape {values.shape[1:]} for items {start}+"
                f"{len(values)} do not match earlier ones {self.array.shape[1:]}"
            )
        self.array[start : start + len(values)] = values

    def fill(self, start: int, count: int, value: float) -> None:
        if self.array is not None:
            self.array[start : start + count] = value


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """A file output of a job (``Client.run(out=...)``), and how it is written.

    ``path``: raw outputs as `.npy`, answers (each image's top classes, named) as .csv or
    .jsonl; None: answers on the terminal (with ``top_k``).  ``top_k``: classes per answer
    (None: raw outputs, or ``DEFAULT_TOP_K`` for an answers file).  ``card``: the labels
    that name answers (None: the broker's copy of the model's).  ``journal``: keep
    ``OUT.journal`` so that a killed job can be finished; ``resume``: finish the job that
    journal belongs to.  ``inputs``: other files the job reads (list files), never
    written.  ``nan_shape``: one output's shape, asked only if no result came, so that a
    `.npy` of a job whose every item failed is written too (NaN rows).
    """

    path: str | None = None
    top_k: int | None = None
    card: ModelCard | None = None
    journal: bool = True
    resume: bool = False
    inputs: tuple[str, ...] = ()
    nan_shape: Callable[[], tuple[int, ...] | None] | None = None

    @property
    def answers(self) -> int | None:
        """Classes per answer; None: raw outputs."""
        if self.top_k is None and not (self.path and Path(self.path).suffix.lower() in FORMATS):
            return None
        return self.top_k or DEFAULT_TOP_K

    @property
    def journaled(self) -> bool:
        return self.journal and self.path is not None

    def problem(self) -> str | None:
        """Why this output cannot be written (a suffix for neither raw outputs nor answers);
        None: it can."""
        if self.path is None:
            return None if self.top_k else "an OutputSpec needs a path, or top_k (the terminal)"
        if self.answers is None and not self.path.lower().endswith(".npy"):
            return f"{self.path}: write raw outputs as .npy, or answers as .csv or .jsonl"
        if self.answers is not None and Path(self.path).suffix.lower() not in FORMATS:
            return f"{self.path}: answers (top_k) are written as .csv or .jsonl"
        return None


#: ``Client.run``'s ``out``: a file (a path or an ``OutputSpec``), an array or a sink of the
#: caller's, or None (memory).
Output = OutputSpec | str | os.PathLike[str] | np.ndarray | ResultSink | None


def output_of(
    out: Output, resume: bool | str | os.PathLike[str]
) -> OutputSpec | np.ndarray | ResultSink | None:
    """``Client.run``'s ``out`` and ``resume``, a path made a spec; ``resume=PATH`` (the
    older form) is ``out=PATH, resume=True``.  FarmError for what does not go together."""
    if isinstance(resume, (str, os.PathLike)):
        if out is not None:
            raise FarmError("give out or resume, not both")
        out, resume = resume, True
    if isinstance(out, (str, os.PathLike)):
        out = OutputSpec(path=os.fspath(out))
    if not isinstance(out, OutputSpec) or out.path is None:
        if resume:
            raise FarmError("resume needs out: the file of the job to resume")
        if not isinstance(out, OutputSpec):
            return out
    problem = out.problem()
    if problem is not None:
        raise FarmError(problem)
    return dataclasses.replace(out, resume=True) if resume else out


def check_outputs(spec: OutputSpec, source: Source) -> None:
    """A look at ``spec``'s file before the job, held by nothing: OutputRefused if it is one
    of the job's inputs, if another job is writing it, or (journaled, no ``resume``) if an
    unfinished job's journal is there; FarmError if its folder cannot be written."""
    if spec.path is None:
        return
    writable(spec.path)
    refuse_input(spec.path, source, spec.inputs)
    try:
        check_free(spec.path)
    except OutputBusy as exc:
        raise OutputRefused(str(exc)) from exc
    if spec.journaled:
        refuse_unfinished(spec)


def writable(path: str) -> None:
    """FarmError unless ``path``'s folder is there and writable."""
    if not os.access(Path(path).resolve().parent, os.W_OK):
        raise FarmError(f"cannot write {path}: its folder does not exist or is not writable")


def refuse_input(
    path: str | os.PathLike[str], source: Source, others: tuple[str, ...] = ()
) -> None:
    """OutputRefused if ``path``, or a file written beside it, is one of the job's input
    files (or of ``others``: list files, say)."""
    try:
        check_not_input(path, source, [arg for arg in others if os.path.isfile(arg)])
    except OutputIsInput as exc:
        raise OutputRefused(str(exc)) from exc


def refuse_unfinished(spec: OutputSpec) -> None:
    """OutputRefused if an unfinished job's journal is there and ``resume`` was not asked."""
    assert spec.path is not None
    journal = journal_path(spec.path)
    if spec.resume or not journal.exists():
        return
    partial = partial_path(spec.path)
    held = (
        f"{partial} holds its outputs so far"
        if partial.exists()
        else f"{spec.path} lacks the images that did not come back"
    )
    raise OutputRefused(
        f"{journal} is there: the job writing {spec.path} did not finish ({held}); "
        f"add --resume to finish that job, or delete {journal} to start afresh"
    )


@contextlib.contextmanager
def guarded(spec: OutputSpec, source: Source, notice: Callable[[str], None]) -> Iterator[None]:
    """``spec.path`` checked (``refuse_input``, ``refuse_unfinished``) and locked while the
    job writes it: OutputRefused, nothing written, if another job holds it.  ``resume``
    with no journal there: a notice that the job starts afresh."""
    assert spec.path is not None
    writable(spec.path)
    refuse_input(spec.path, source, spec.inputs)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(output_lock(spec.path))
        except OutputBusy as exc:
            raise OutputRefused(str(exc)) from exc
        if spec.journaled:
            refuse_unfinished(spec)
        if spec.journaled and spec.resume and not journal_path(spec.path).exists():
            notice(f"--resume: no journal at {journal_path(spec.path)}: starting afresh")
        yield


@dataclass
class JobOutputs:
    """A job's opened outputs: the sink ``Client.run`` writes, and where they ended up."""

    sink: ResultSink
    path: str | None = None  # the file of an ``OutputSpec``
    written: bool = False  # ``path`` was written: its partial file renamed to it

    @property
    def held(self) -> bool:
        """Whether a journaled file was left unfinished (``cancel(hold=True)``): its partial
        file and journal kept for a resume, not renamed to ``path``."""
        sink = self.sink
        return isinstance(sink, Journaled) and sink.hold and not sink.published

    def array(self) -> np.ndarray | None:
        """The outputs in memory, or memory-mapped from the `.npy` file written; None for
        answers, a sink of the caller's, or no file."""
        if isinstance(self.sink, ArraySink):
            return self.sink.array
        if self.written and not isinstance(self.sink, AnswerSink) and self.path:
            return np.load(self.path, mmap_mode="r")
        return None


@contextlib.contextmanager
def open_outputs(
    out: OutputSpec | np.ndarray | ResultSink | None,
    source: Source,
    job: Callable[[], JournalHeader],
    card: Callable[[], ModelCard],
    notice: Callable[[str], None],
) -> Iterator[JobOutputs]:
    """The outputs ``out`` (``output_of``) says, open for the job: a spec's file guarded
    (``guarded``) and closed at its end, renamed to its path once whole (journaled: by
    ``Journaled.finish``); an array or a sink of the caller's as given (OutputRefused if an
    ``NpyWriter``'s file is an input); None: memory.  ``job``: the journal's header;
    ``card``: the model's labels, asked only for answers without ``OutputSpec.card``."""
    if isinstance(out, OutputSpec):
        with file_outputs(out, source, job, card, notice) as outputs:
            yield outputs
    elif out is None or isinstance(out, np.ndarray):
        yield JobOutputs(ArraySink(len(source), out))
    else:
        if isinstance(out, NpyWriter):
            refuse_input(out.path, source)
        yield JobOutputs(out)


@contextlib.contextmanager
def file_outputs(
    spec: OutputSpec,
    source: Source,
    job: Callable[[], JournalHeader],
    card: Callable[[], ModelCard],
    notice: Callable[[str], None],
) -> Iterator[JobOutputs]:
    """``spec``'s sink, its file guarded while the job writes it, closed at the job's end
    and then renamed to its path if whole (journaled: by ``Journaled.finish``)."""
    with contextlib.ExitStack() as stack:
        if spec.path is not None:
            stack.enter_context(guarded(spec, source, notice))
        sink = open_sink(spec, source, job, card, notice)
        outputs = JobOutputs(sink, spec.path)
        try:
            yield outputs
        finally:
            sink.close()
        outputs.written = published(sink, spec.path, len(source))


FileSink = JournalSink | AnswerSink | NpyWriter


def open_sink(
    spec: OutputSpec,
    source: Source,
    job: Callable[[], JournalHeader],
    card: Callable[[], ModelCard],
    notice: Callable[[str], None],
) -> FileSink:
    """The sink writing ``spec``'s file: answers, a journaled `.npy`, or a plain one
    (``OUT.partial``).  ResumeRefused if the journal there is another job's."""
    path = spec.path
    if spec.answers is not None:
        return open_answers(spec, source, job, spec.card or card(), notice)
    assert path is not None
    if not spec.journal:
        return NpyWriter(partial_path(path), len(source), spec.nan_shape)
    try:
        return JournalSink.open(path, job(), spec.nan_shape)
    except JournalMismatch as exc:
        raise ResumeRefused(str(exc)) from exc


def open_answers(
    spec: OutputSpec,
    source: Source,
    job: Callable[[], JournalHeader],
    card: ModelCard,
    notice: Callable[[str], None],
) -> AnswerSink:
    """An answers sink: a journaled file (``AnswersJournal``), a plain one, or the
    terminal; the notice says when ``top_k`` was cut to the model's classes."""
    assert spec.answers is not None
    k, cut = card.top_k(spec.answers)
    if cut:
        notice(cut)
    path = spec.path
    if path is None or not spec.journal:
        writer = open_writer(path, card, k, partial_path(path) if path else None)
        return AnswerSink(k, card, writer, source.names)
    header = dataclasses.replace(job(), format=answers_format(path), top_k=k)
    try:
        return AnswersJournal.open(path, header, card, source.names)
    except JournalMismatch as exc:
        raise ResumeRefused(str(exc)) from exc


def published(sink: FileSink, path: str | None, total: int) -> bool:
    """Whether the job's file was written to ``path``: renamed by ``finish`` (journaled),
    else here once every row is there."""
    if isinstance(sink, JournalSink | AnswersJournal):
        return sink.published
    if isinstance(sink, AnswerSink):
        whole = path is not None and sink.next_row == total
    else:  # a plain `.npy`: whole once it has a row (the others filled)
        whole = path is not None and sink.item_shape is not None
    if whole:
        assert path is not None
        publish(partial_path(path), Path(path))
    return whole
