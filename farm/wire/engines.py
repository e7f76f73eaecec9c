"""A job's engine choice as the wire carries it: the backend and precisions its chunks run in.

A choice is one precision on one backend (``auto``: the fastest that agrees, chosen per
model), or the precision gate's verdict: the precisions that passed, fastest first, as
measured on one backend (int8 naming the version judged, by its calibration), then f32
on the worker's own backend.  It is checked once, when built or decoded: msgspec turns
the ValueError of ``__post_init__`` into a decode error, so a malformed choice from a
peer is refused with its message.  ``EngineChoice.parse`` is the one reader of the text
users type (``--precision openvino:int8@3fa9c1e2d4b5,bf16,f32``).  The names live here,
and ``farm.engines`` takes them from here, so the broker checks a choice without
importing the engines.
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
#: Hex digits of an int8 version's calibration digest that a gated choice names.
CALIBRATION_PREFIX = 12

Name = Annotated[str, Meta(max_length=20)]
Version = Annotated[str, Meta(min_length=CALIBRATION_PREFIX, max_length=CALIBRATION_PREFIX)]


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

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            where = "" if self.backend == AUTO else f" on backend {self.backend}"
            raise ValueError(f"engine choice: precision {self.precision_text()}{where}: {problem}")

    def problem(self) -> str | None:
        """Why this choice is malformed, or None."""
        if self.backend not in (AUTO, *BACKEND_NAMES):
            return f"backend {self.backend!r} is not {AUTO} or one of {', '.join(BACKEND_NAMES)}"
        unknown = [name for name in self.precisions if name not in PRECISIONS]
        if unknown or len(set(self.precisions)) != len(self.precisions):
            return f"precisions must be distinct names of {', '.join(PRECISIONS)}"
        if self.gated and (self.precisions[-1] != "f32" or self.measured_on not in BACKEND_NAMES):
            return "a gated list ends in f32 and names the backend that measured it"
        if not self.gated and self.measured_on is not None:
            return "one precision names no measuring backend"
        if self.int8_version is not None and not self.names_int8_version():
            return f"int8's version is {CALIBRATION_PREFIX} hex digits, in a gated list with int8"
        return None

    def names_int8_version(self) -> bool:
        """Whether ``int8_version`` is well formed, in a gated list that holds int8."""
        version = self.int8_version or ""
        hexadecimal = all(digit in "0123456789abcdef" for digit in version)
        well_formed = len(version) == CALIBRATION_PREFIX and hexadecimal
        return well_formed and self.gated and "int8" in self.precisions

    @property
    def gated(self) -> bool:
        """Whether this is the precision gate's list (more than one precision)."""
        return len(self.precisions) > 1

    def calibration(self, precision: str) -> str:
        """The int8 version a precision of the list must be (empty: any, or not int8)."""
        return (self.int8_version or "") if precision == "int8" else ""

    def precision_text(self) -> str:
        """The precision as ``--precision`` takes it: ``bf16``, or the gate's list
        ``openvino:int8@3fa9c1e2d4b5,bf16,f32``."""
        listed = ",".join(
            f"{name}@{self.int8_version}" if name == "int8" and self.int8_version else name
            for name in self.precisions
        )
        return f"{self.measured_on}:{listed}" if self.gated else listed

    def __str__(self) -> str:
        return f"{self.backend} {self.precision_text()}"

    @classmethod
    def parse(cls, backend: str, precision: str) -> EngineChoice:
        """A choice from a backend name and ``--precision`` text (one precision, or the
        gate's list); ValueError saying what is malformed."""
        measured_on, _, listed = precision.rpartition(":")
        names, versions = [], []
        for token in listed.split(","):
            name, at, version = token.partition("@")
            names.append(name)
            if at:
                versions.append((name, version.lower()))
        if len(versions) > 1 or any(name != "int8" for name, _ in versions):
            raise ValueError(f"precision {precision!r}: only int8 names a version (int8@...)")
        return cls(
            backend,
            tuple(names),
            measured_on or None,
            versions[0][1] if versions else None,
        )
