"""int8 versions of a model: farm's ONNX export quantized on the user's calibration images.

``farm models quantize NAME --calibration IMAGES`` runs ONNX Runtime's static
quantization (``onnxruntime.quantization.quantize_static``: QDQ nodes, weights per output
channel) on the export that takes uint8 images with the preprocessing folded in, so the
calibration images go through exactly the preprocessing of a job.  Both CPU engines run
the result: OpenVINO and ONNX Runtime execute QDQ graphs with int8 kernels (VNNI, AMX).

The file sits next to the f32 export (``$FARM_CACHE/onnx``), named by the model's digest
and the calibration set's; a record beside it (``-int8.json``) names the current one,
with the libraries and export format that made it.  The calibration images are kept
too: a version made by other library versions is made again when it is next opened
(``quantized_file``), never trusted and never used in the meantime; so is a file whose
bytes differ from the digest recorded beside it when it was written
(``farm.modelrepo.sealed``), and its calibration images must still hash to theirs.  A
net with no layer that has an int8 kernel raises ``Unquantizable``; callers run it in
f32 and say why.

Whether int8 answers are good enough is not decided here but by the precision gate
(``farm.engines.gate``), on the user's own validation images.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

import numpy as np

from farm import defaults
from farm.engines import onnx_export
from farm.modelrepo import sealed
from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, cache_root

log = logging.getLogger("farm.engines.quantize")

#: Fewest calibration images taken: the activation ranges of fewer images fit those images,
#: not the job's.  OpenVINO's and NNCF's default calibration subset is 300 images
#: (``defaults.CALIBRATION_IMAGES``).
MIN_CALIBRATION = 100
#: Images per calibration batch (each batch's activations are gathered at once).
CALIBRATION_BATCH = 10
#: Bumped when the recipe changes: a file made by an older recipe is made again.
RECIPE = 1
#: The libraries whose versions a quantized file depends on.
LIBRARIES = ("onnxruntime", "onnx")
#: Op types with int8 kernels in both CPU engines: the layers that quantizing speeds up.
COMPUTING = {"Conv", "Gemm", "MatMul", "ConvTranspose"}
#: What a quantized file's record calls it (``farm.modelrepo.sealed``).
CACHED = "int8 version"


class QuantizeError(ModelError):
    """The model or the calibration set cannot give an int8 version; the message says why."""


class Unquantizable(QuantizeError):
    """No int8 version can be made of the net: it runs in f32."""


@dataclass
class Quantized:
    """One int8 version of a model, as its record on disk describes it."""

    model: str
    model_digest: str
    calibration_digest: str
    images: int
    file: str  # the quantized ONNX file's name, in the export folder
    versions: dict[str, str]  # the libraries, the recipe and the export format that made it
    quantized_layers: int = 0
    float_layers: list[str] = field(default_factory=list)  # computing op types left in f32
    seconds: float = 0.0

    @property
    def path(self) -> Path:
        return export_folder() / self.file

    @property
    def calibration_path(self) -> Path:
        """The calibration images, kept to make the version again."""
        return self.path.with_name(f"{self.path.stem}-calibration.npy")

    @property
    def fresh(self) -> bool:
        """Made by the libraries, recipe and export format installed now."""
        return self.versions == library_versions() and self.path.is_file()

    def describe(self) -> str:
        kept = f"; kept in f32: {', '.join(self.float_layers)}" if self.float_layers else ""
        stale = "" if self.fresh else "; made by other library versions: made again when used"
        return (
            f"int8 version of {self.model}: {self.quantized_layers} layers quantized on "
            f"{self.images} calibration images ({self.calibration_digest[:12]}){kept}{stale}"
        )


def library_versions() -> dict[str, str]:
    """The installed versions of the quantizing libraries, the recipe and the export format."""
    found = {"recipe": str(RECIPE), "export": str(onnx_export.FORMAT)}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def cache_format() -> str:
    """The format a quantized file's record names."""
    return f"farm int8 recipe {RECIPE} of onnx export v{onnx_export.FORMAT}"


def export_folder() -> Path:
    return cache_root() / "onnx"


def record_path(spec: ModelSpec, digest: str | None = None) -> Path:
    """Where the record of the model's current int8 version is kept."""
    digest = digest or manifest_of(spec).digest
    return export_folder() / f"{spec.name}-{digest[:24]}-int8.json"


def images_digest(images: np.ndarray) -> str:
    """What keys a set of images (calibration, validation): its shape, dtype and bytes."""
    hasher = hashlib.sha256(f"{images.dtype.str}{images.shape}".encode())
    hasher.update(np.ascontiguousarray(images).data)
    return hasher.hexdigest()


def check_calibration(spec: ModelSpec, images: np.ndarray) -> None:
    """QuantizeError unless ``images`` are at least ``MIN_CALIBRATION`` uint8 images of the
    model's input shape."""
    if images.dtype != np.uint8 or images.shape[1:] != tuple(spec.item_shape):
        raise QuantizeError(
            f"calibration images must be uint8 images of {spec.name}'s input shape "
            f"{tuple(spec.item_shape)}, got {images.dtype} {images.shape[1:]}"
        )
    if len(images) < MIN_CALIBRATION:
        raise QuantizeError(
            f"{len(images)} calibration images are too few: int8 ranges measured on fewer "
            f"than {MIN_CALIBRATION} images fit those images, not a job's "
            f"({defaults.CALIBRATION_IMAGES} recommended)"
        )


def quantize(spec: ModelSpec, images: np.ndarray) -> Quantized:
    """Make the int8 version of ``spec`` from ``images`` (N x item shape, uint8) and make it
    the model's current one; QuantizeError (Unquantizable) when it cannot be made, with
    nothing written."""
    check_calibration(spec, images)
    digest = manifest_of(spec).digest
    calibration = images_digest(images)
    name = f"{spec.name}-{digest[:24]}-v{onnx_export.FORMAT}-u8-int8-{calibration[:12]}.onnx"
    record = Quantized(spec.name, digest, calibration, len(images), name, library_versions())
    started = time.perf_counter()
    try:
        source = onnx_export.exported_onnx(spec, folded=True)
    except (onnx_export.ExportError, ModelError) as exc:
        raise Unquantizable(f"farm cannot export the net to quantize it: {exc}") from exc
    try:
        export_folder().mkdir(parents=True, exist_ok=True)
        record.quantized_layers, record.float_layers = quantize_file(source, record.path, images)
        write_atomically(record.calibration_path, lambda path: np.save(path, images))
        record.seconds = round(time.perf_counter() - started, 2)
        write_atomically(
            record_path(spec, digest), lambda path: path.write_text(json.dumps(asdict(record)))
        )
    except OSError as exc:
        raise QuantizeError(f"cannot write the int8 version into {export_folder()}: {exc}") from exc
    log.info("%s in %.1f s", record.describe(), record.seconds)
    return record


def recorded(spec: ModelSpec, digest: str | None = None) -> Quantized | None:
    """The record of the model's current int8 version, as it is (None when there is none or
    it cannot be read); cheap: nothing is made."""
    path = record_path(spec, digest)
    known = {each.name for each in fields(Quantized)}
    try:
        document = json.loads(path.read_text())
        return Quantized(**{key: value for key, value in document.items() if key in known})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring unreadable int8 record %s: %s", path, exc)
        return None


def quantized_file(spec: ModelSpec, calibration: str = "") -> Path:
    """The model's current int8 file, made again first when other library versions made
    it; ``calibration``: the start of the calibration digest it must have (the version the
    precision gate judged).  ModelError saying why when there is none to use."""
    record = recorded(spec)
    if record is None:
        raise ModelError(
            f"model {spec.name!r} has no int8 version here: make one with `farm models "
            f"quantize {spec.name} --calibration IMAGES`"
        )
    if not record.calibration_digest.startswith(calibration):
        raise ModelError(
            f"model {spec.name!r}: the int8 version here ({record.calibration_digest[:12]}) "
            f"is not the one the precision gate judged ({calibration})"
        )
    if not (record.fresh and sealed.verified(record.path, CACHED, cache_format())):
        record = remake(spec, record)
    return record.path


def remake(spec: ModelSpec, record: Quantized) -> Quantized:
    """The int8 version made again from its kept calibration images; ModelError if it
    cannot be."""
    log.info("%s: making it again with %s", record.describe(), library_versions())
    try:
        images = np.load(record.calibration_path)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"{record.describe()}, and its calibration images cannot be read ({exc}): run "
            f"farm models quantize {spec.name} again"
        ) from exc
    if images_digest(images) != record.calibration_digest:
        raise ModelError(
            f"{record.describe()}, and its calibration images {record.calibration_path} no "
            f"longer hash to {record.calibration_digest[:12]} (tampered or damaged): run "
            f"farm models quantize {spec.name} again"
        )
    return quantize(spec, images)


def quantize_file(source: Path, target: Path, images: np.ndarray) -> tuple[int, list[str]]:
    """Quantize the ONNX graph at ``source`` into ``target``, calibrated on ``images``; the
    number of layers quantized and the op types left in f32.  Unquantizable says why."""
    try:
        import onnx
        from onnxruntime.quantization import (
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_static,
        )
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError as exc:
        raise Unquantizable(
            f"quantizing needs ONNX Runtime and onnx ({exc}): pip install onnxruntime onnx"
        ) from exc

    input_name = onnx.load(str(source), load_external_data=False).graph.input[0].name

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = calibration_batches(images, input_name)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    with tempfile.TemporaryDirectory(prefix=".quantizing-", dir=target.parent) as scratch:
        partial, prepared = Path(scratch) / target.name, Path(scratch) / "prepared.onnx"
        try:
            # shape inference and graph optimisation first, as ONNX Runtime asks
            quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
            quantize_static(
                str(prepared),
                str(partial),
                Batches(),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
            )
        except Exception as exc:  # the library's own errors: say which, fall back to f32
            raise Unquantizable(
                f"ONNX Runtime cannot quantize it: {type(exc).__name__}: {exc}"
            ) from exc
        layers, float_ops = quantized_layers(onnx.load(str(partial)))
        if layers == 0:
            raise Unquantizable(
                f"no layer of the net has an int8 kernel (farm quantizes "
                f"{', '.join(sorted(COMPUTING))} layers; this net has none that could be)"
            )
        sealed.install(partial, target, cache_format())  # its digest recorded first
    return layers, float_ops


def calibration_batches(images: np.ndarray, input_name: str) -> Iterator[dict[str, np.ndarray]]:
    """Equal batches of calibration images (a short last batch is dropped: the calibrators
    stack each batch's activations)."""
    for start in range(0, len(images) - CALIBRATION_BATCH + 1, CALIBRATION_BATCH):
        yield {input_name: images[start : start + CALIBRATION_BATCH]}


def quantized_layers(model: object) -> tuple[int, list[str]]:
    """How many computing layers take int8 inputs (fed by a DequantizeLinear), and the op
    types of those left in f32."""
    nodes = model.graph.node  # type: ignore[attr-defined]
    dequantized = {
        out for node in nodes if node.op_type == "DequantizeLinear" for out in node.output
    }
    computing = [node for node in nodes if node.op_type in COMPUTING]
    quantized = [node for node in computing if node.input and node.input[0] in dequantized]
    left = {node.op_type for node in computing if node not in quantized}
    return len(quantized), sorted(left)


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary name beside it, so readers see all of it or none."""
    sealed.write(path, write)
