"""Answers, not scores: the top-k classes of each image, named, in input order.

An ``AnswerSink`` is a client ``ResultSink``: it takes each chunk's raw outputs as
they arrive (in any order), keeps only each image's top-k classes and their
probabilities (a softmax is applied where the net ends before one), and writes one
row per image in input order as soon as every earlier image is answered: to a
CSV file, a JSON Lines file, or the terminal.  A failed image gets a row with its
reason.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

#: Answer file formats by suffix.
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
#: Classes an answers file lists when no --top-k is given.
DEFAULT_TOP_K = 5


@dataclass(frozen=True)
class ModelCard:
    """What naming a model's answers takes: its class names, and whether its output is
    already a probability (the net ends in a Softmax layer)."""

    labels: tuple[str, ...] = ()
    softmax: bool = False

    def name(self, index: int) -> str:
        return self.labels[index] if index < len(self.labels) else str(index)

    def top_k(self, k: int) -> tuple[int, str | None]:
        """``--top-k k`` within the model's classes (when its labels count them), and the
        notice when it was cut down."""
        classes = len(self.labels)
        if not classes or k <= classes:
            return k, None
        return classes, f"--top-k {k}: the model has {classes} classes; each answer lists them all"


@dataclass(frozen=True)
class Answer:
    """One image's answer: its top classes with their probabilities, or why it failed."""

    index: int
    name: str
    ids: tuple[int, ...] = ()
    probabilities: tuple[float, ...] = ()
    error: str | None = None


def top_k(outputs: np.ndarray, k: int, softmax: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best classes of each row (best first) and their probabilities."""
    scores = outputs.reshape(len(outputs), -1).astype(np.float64)
    if softmax:
        scores = np.exp(scores - scores.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    k = min(k, scores.shape[1])
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(best, order, axis=1)
    return ids, np.take_along_axis(scores, ids, axis=1)


class TextFile(Protocol):
    """Where an answers file's text goes: an open text file, or a ``CountedFile``."""

    def write(self, text: str, /) -> int: ...

    def close(self) -> None: ...


class AnswerWriter(Protocol):
    """Where answers go, one row per image, in input order."""

    def row(self, answer: Answer) -> None: ...

    def close(self) -> None: ...


@dataclass
class CsvAnswers:
    """``path,id_1,name_1,probability_1,...,error``: one row per image, after a heading row
    (``heading``: False for a file that has it, resumed)."""

    handle: TextFile
    card: ModelCard
    k: int
    writer: Any = field(init=False)
    heading: bool = True

    def __post_init__(self) -> None:
        self.writer = csv.writer(self.handle)
        ranks = [
            f"{what}_{rank}"
            for rank in range(1, self.k + 1)
            for what in ("id", "name", "probability")
        ]
        if self.heading:
            self.writer.writerow(["path", *ranks, "error"])

    def row(self, answer: Answer) -> None:
        cells: list[Any] = []
        for class_id, probability in zip(answer.ids, answer.probabilities):
            cells += [class_id, self.card.name(class_id), f"{probability:.6g}"]
        cells += [""] * (3 * self.k - len(cells))
        self.writer.writerow([answer.name, *cells, answer.error or ""])

    def close(self) -> None:
        self.handle.close()


@dataclass
class JsonlAnswers:
    """``{"path": ..., "top": [{"id", "name", "probability"}...]}`` (or ``"error"``) per line."""

    handle: TextFile
    card: ModelCard

    def row(self, answer: Answer) -> None:
        document: dict[str, Any] = {"path": answer.name}
        if answer.error is not None:
            document["error"] = answer.error
        else:
            document["top"] = [
                {
                    "id": class_id,
                    "name": self.card.name(class_id),
                    "probability": round(probability, 6),
                }
                for class_id, probability in zip(answer.ids, answer.probabilities)
            ]
        self.handle.write(json.dumps(document) + "\n")

    def close(self) -> None:
        self.handle.close()


@dataclass
class TerminalAnswers:
    """``photos/cat.jpg: tabby 41.2%; tiger cat 30.1%; ...`` per image, on stdout (above
    any progress bar; ``;`` between classes, as names such as ``tabby, tabby cat`` hold
    commas)."""

    card: ModelCard
    handle: IO[str] = field(default_factory=lambda: sys.stdout)

    def row(self, answer: Answer) -> None:
        from tqdm import tqdm

        if answer.error is not None:
            text = f"FAILED: {answer.error}"
        else:
            text = "; ".join(
                f"{self.card.name(class_id)} {probability:.1%}"
                for class_id, probability in zip(answer.ids, answer.probabilities)
            )
        tqdm.write(f"{answer.name}: {text}", file=self.handle)

    def close(self) -> None:
        self.handle.flush()


def answers_format(path: str | os.PathLike[str]) -> str:
    """An answers file's format by its suffix: csv or jsonl; ValueError for another."""
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: answers are written as .csv or .jsonl (raw scores as .npy)")
    return kind


def open_writer(
    path: str | None, card: ModelCard, k: int, file: str | os.PathLike[str] | None = None
) -> AnswerWriter:
    """A writer for an answers file by its suffix (.csv, .jsonl); None: the terminal.
    ``file``: where to write it instead (``path``'s ``.partial`` file).  ValueError for
    another suffix."""
    if path is None:
        return TerminalAnswers(card)
    kind = answers_format(path)
    handle = open(file or path, "w", newline="" if kind == "csv" else None, encoding="utf-8")
    return CsvAnswers(handle, card, k) if kind == "csv" else JsonlAnswers(handle, card)


@dataclass
class AnswerSink:
    """A client sink that writes answers in input order as results arrive.

    ``names(start, count)`` names items (their paths).  Rows wait in memory only until
    the images before them are answered: top-k ids and probabilities, not whole outputs.
    """

    k: int
    card: ModelCard
    writer: AnswerWriter
    names: Callable[[int, int], Sequence[str]]
    waiting: dict[int, Answer] = field(default_factory=dict)
    next_row: int = 0

    def write(self, start: int, values: np.ndarray) -> None:
        ids, probabilities = top_k(values, self.k, not self.card.softmax)
        names = self.names(start, len(values))
        for offset in range(len(values)):
            self.waiting[start + offset] = Answer(
                start + offset,
                names[offset],
                tuple(ids[offset].tolist()),
                tuple(probabilities[offset].tolist()),
            )
        self.flush()

    def fill(self, start: int, count: int, value: float) -> None:
        """Failed items: their rows come from ``fail``, with the reason."""

    def fail(self, start: int, count: int, error: str) -> None:
        """Items that did not come back, and why: rows with the reason."""
        for offset, name in enumerate(self.names(start, count)):
            self.waiting[start + offset] = Answer(start + offset, name, error=error)
        self.flush()

    def flush(self) -> None:
        """Write every row whose earlier rows are written."""
        while self.next_row in self.waiting:
            self.writer.row(self.waiting.pop(self.next_row))
            self.next_row += 1

    def close(self) -> None:
        self.flush()
        self.writer.close()
