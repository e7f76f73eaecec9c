"""A job's engine choice as the wire carries it: the backend and precisions its chunks run in.

A choice is one precision on one backend (``auto``: the fastest that agrees, chosen per
model), or the precision gate's verdict: the precisions that passed, fastest first, as
measured on one backend (int8 naming the version judged, by its calibration), then f32
on the worker's own backend.  A cascade (``bf16+f32``) runs the fast precision, then f32
again for the images whose top-1 to top-2 margin is at most its margin (``margins``, one
per cascade, fitted by the precision gate).  It is checked once, when built or decoded:
msgspec turns the ValueError of ``__post_init__`` into a decode error, so a malformed
choice from a peer is refused with its message.  ``EngineChoice.parse`` is the one reader
of the text users type (``--precision openvino:int8+f32@3fa9c1e2d4b5=2.5,bf16,f32``).
The names live here, and ``farm.engines`` takes them from here, so the broker checks a
choice without importing the engines.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

#: ``auto``: time every installed backend on the model and keep the fastest that agrees.
AUTO = "auto"
#: The backends, in reference order (``farm.engines.engine.BACKENDS`` maps them to classes).
BACKEND_NAMES = ("caffe", "opencv", "torch", "onnxruntime", "openvino")
#: Compute precisions; f32 is the default (``defaults.PRECISION``), the others are opt-in
#: where engine and device support them (int8: a model's version made by ``farm models
#: quantize``, on the engines that run farm's ONNX export).
PRECISIONS = ("f32", "f16", "bf16", "int8")
#: A cascade's name: its fast precision, then f32 again for the images in doubt.
CASCADE = "+f32"
#: Cascades: each precision below f32 with f32 behind it (``bf16+f32``).
CASCADES = tuple(f"{name}{CASCADE}" for name in PRECISIONS[1:])
#: Hex digits of an int8 version's calibration digest that a gated choice names.
CALIBRATION_PREFIX = 12

Name = Annotated[str, Meta(max_length=20)]
Version = Annotated[str, Meta(min_length=CALIBRATION_PREFIX, max_length=CALIBRATION_PREFIX)]
Margin = Annotated[float, Meta(ge=0.0, le=1e30)]  # msgspec refuses NaN and inf by the bounds


def fast_precision(name: str) -> str:
    """The precision a name computes in first: ``bf16`` for ``bf16+f32``, else the name."""
    return name.removesuffix(CASCADE) if name in CASCADES else name


def is_cascade(name: str) -> bool:
    return name in CASCADES


class EngineChoice(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """The engine a job's chunks run on.

    ``backend``: ``auto`` or a backend name, where ``precisions[-1]`` runs.
    ``precisions``: one, or the gate's list, fastest first, ending in f32.
    ``measured_on``: the backend the gate judged a list on, where every precision before
    the last runs.  ``int8_version``: the start of the calibration digest of the int8
    version the gate judged (``CALIBRATION_PREFIX`` hex digits).
    """

    backend: Name = AUTO
    precisions: Annotated[tuple[Name, ...], Meta(min_length=1, max_length=4)] = ("f32",)
    measured_on: Name | None = None
    int8_version: Version | None = None
    margins: Annotated[tuple[Margin, ...], Meta(max_length=4)] = ()

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            where = "" if self.backend == AUTO else f" on backend {self.backend}"
            raise ValueError(f"engine choice: precision {self.precision_text()}{where}: {problem}")

    def problem(self) -> str | None:
        """Why this choice is malformed, or None."""
        if self.backend not in (AUTO, *BACKEND_NAMES):
            return f"backend {self.backend!r} is not {AUTO} or one of {', '.join(BACKEND_NAMES)}"
        unknown = [name for name in self.precisions if name not in (*PRECISIONS, *CASCADES)]
        if unknown or len(set(self.precisions)) != len(self.precisions):
            return f"precisions must be distinct names of {', '.join((*PRECISIONS, *CASCADES))}"
        cascades = sum(map(is_cascade, self.precisions))
        if cascades != len(self.margins):
            return (
                f"each cascade names its margin ({cascades} cascades, {len(self.margins)} margins)"
            )
        if cascades and self.cascade_backend == AUTO:
            return "a cascade runs on a named backend, the one its margin was fitted on"
        if self.gated and (self.precisions[-1] != "f32" or self.measured_on not in BACKEND_NAMES):
            return "a gated list ends in f32 and names the backend that measured it"
        if not self.gated and self.measured_on is not None:
            return "one precision names no measuring backend"
        if self.int8_version is not None and not self.names_int8_version():
            return (
                f"int8's version is {CALIBRATION_PREFIX} hex digits, in a gated list with int8 "
                f"or an int8 cascade"
            )
        return None

    def names_int8_version(self) -> bool:
        """Whether ``int8_version`` is well formed, in a gated list that holds int8."""
        version = self.int8_version or ""
        hexadecimal = all(digit in "0123456789abcdef" for digit in version)
        well_formed = len(version) == CALIBRATION_PREFIX and hexadecimal
        int8 = any(fast_precision(name) == "int8" for name in self.precisions)
        return well_formed and int8 and (self.gated or self.precisions[0] == f"int8{CASCADE}")

    @property
    def gated(self) -> bool:
        """Whether this is the precision gate's list (more than one precision)."""
        return len(self.precisions) > 1

    @property
    def cascade_backend(self) -> str:
        """Where the list's cascades run: the gate's backend, else the choice's."""
        return self.measured_on or self.backend

    def calibration(self, precision: str) -> str:
        """The int8 version a precision of the list must be (empty: any, or not int8)."""
        return (self.int8_version or "") if fast_precision(precision) == "int8" else ""

    def margin(self, precision: str) -> float:
        """A cascade's margin (ValueError for a name that is not one of the list's cascades)."""
        cascades = [name for name in self.precisions if is_cascade(name)]
        return self.margins[cascades.index(precision)]

    def precision_text(self) -> str:
        """The precision as ``--precision`` takes it: ``bf16``, or the gate's list
        ``openvino:int8@3fa9c1e2d4b5,bf16,f32``."""
        listed = ",".join(map(self.token, self.precisions))
        return f"{self.measured_on}:{listed}" if self.gated else listed

    def token(self, name: str) -> str:
        """One precision of the list as text: ``int8+f32@3fa9c1e2d4b5=2.5``."""
        version = self.calibration(name)
        cascades = [each for each in self.precisions if is_cascade(each)]
        known = is_cascade(name) and cascades.index(name) < len(self.margins)
        margin = f"={self.margin(name):.6g}" if known else ""
        return f"{name}{'@' if version else ''}{version}{margin}"

    def __str__(self) -> str:
        return f"{self.backend} {self.precision_text()}"

    @classmethod
    def parse(cls, backend: str, precision: str) -> EngineChoice:
        """A choice from a backend name and ``--precision`` text (one precision, or the
        gate's list); ValueError saying what is malformed."""
        measured_on, _, listed = precision.rpartition(":")
        names, versions, margins = [], [], []
        for token in listed.split(","):
            token, equals, margin = token.partition("=")
            name, at, version = token.partition("@")
            names.append(name)
            if at:
                versions.append((name, version.lower()))
            if equals:
                margins.append(parsed_margin(precision, margin))
        if len(versions) > 1 or any(fast_precision(name) != "int8" for name, _ in versions):
            raise ValueError(f"precision {precision!r}: only int8 names a version (int8@...)")
        return cls(
            backend,
            tuple(names),
            measured_on or None,
            versions[0][1] if versions else None,
            tuple(margins),
        )


def parsed_margin(precision: str, text: str) -> float:
    """A cascade's margin as text gives it (``bf16+f32=0.25``); ValueError if it is not a
    finite number of at least 0."""
    try:
        margin = float(text)
    except ValueError:
        margin = -1.0
    if not 0.0 <= margin < float("inf"):
        raise ValueError(
            f"precision {precision!r}: a cascade's margin is a number >= 0, not {text!r}"
        )
    return margin
