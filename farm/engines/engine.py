"""Inference engines: one model loaded in one backend, run in compute batches.

Every backend builds from the same checked ``Network`` and preprocesses as the
same ``Transformer``; a backend only supplies ``forward`` (one batch in, the output
blob out) and ``shrink`` (drop buffers sized for a batch larger than the net's
resting one).  ``Engine.folds`` alone decides where the preprocessing runs: the
backends that run farm's ONNX export take uint8 images as they are, into a graph
with the preprocessing folded in (no float32 copy on the host); every other input,
and every other backend, gets the host's float32 batch.  Backends are imported
lazily, so commands that never run a model start fast and the default install needs
no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from farm import defaults
from farm.engines import quantize
from farm.engines.onnx_export import exported_onnx, onnx_path
from farm.engines.preprocess import Transformer
from farm.modelrepo.caffe_net import Network, NetworkError
from farm.modelrepo.repository import ModelError, ModelSpec, prepare
from farm.wire.engines import AUTO, BACKEND_NAMES, PRECISIONS

log = logging.getLogger("farm.engines.engine")

#: Environment variables that cap the thread pools of OpenMP and the BLAS libraries.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)

#: Backend name -> "module:class", the reference order: the first that runs a model is the one
#: the others' outputs are checked against (pycaffe is Caffe itself; OpenCV's importer and
#: torch are farm's older backends; the last two run farm's own ONNX export of the net).
BACKENDS = {
    "caffe": "farm.engines.backends.pycaffe:CaffeEngine",
    "opencv": "farm.engines.backends.opencv:OpenCVEngine",
    "torch": "farm.engines.backends.pytorch:TorchEngine",
    "onnxruntime": "farm.engines.backends.onnxruntime:OnnxRuntimeEngine",
    "openvino": "farm.engines.backends.openvino:OpenVINOEngine",
}
assert tuple(BACKENDS) == BACKEND_NAMES  # the wire's names (``farm.wire.engines``)
#: What a GPU worker needs installed at least (``Device.check``).
GPU_BACKEND = "torch"


@dataclass
class RunStats:
    """Where one ``Engine.run``'s time went: seconds the device computed (preprocessing
    included), and seconds of copies between host and GPU (measured by CUDA events; zero
    where the device is the host); a cascade's images run again in f32
    (``farm.engines.cascade``)."""

    device: float = 0.0
    copy: float = 0.0
    rerun: tuple[int, ...] = ()  # a cascade's: the indices of the images run again in f32


class Stopped(Exception):
    """A chunk's compute was stopped between batches (its job was cancelled)."""


class BackendUnavailable(ModelError):
    """A backend whose library cannot be imported here; the message says how to install it."""


def limit_threads(threads: int | None) -> None:
    """Cap compute threads; call before OpenCV or torch is imported. None keeps the defaults."""
    if threads is None:
        return
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``); a no-op elsewhere."""
    library = libc()
    if library is not None and hasattr(library, "malloc_trim"):
        library.malloc_trim(0)


class SignalStack(ctypes.Structure):
    """glibc's ``stack_t``, for ``sigaltstack``."""

    _fields_ = [
        ("ss_sp", ctypes.c_void_p),
        ("ss_flags", ctypes.c_int),
        ("ss_size", ctypes.c_size_t),
    ]


@functools.cache
def libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def kept_signal_stack() -> Iterator[None]:
    """Give the calling thread back its signal stack after a library call.

    Compiling or running a net with OpenVINO 2026.4 can leave the thread a
    ``sigaltstack`` of its own (11 568 bytes), freed with the net.  Python runs its
    signal handlers on the alternate stack (``SA_ONSTACK``), so a Ctrl-C after the net was
    gone wrote onto freed memory: ``farm run --precision auto``, whose gate runs and drops
    nets before the job, died of SIGSEGV when interrupted.  A no-op without glibc."""
    library = libc()
    saved = SignalStack()
    if library is None or library.sigaltstack(None, ctypes.byref(saved)) != 0:
        yield
        return
    try:
        yield
    finally:
        library.sigaltstack(ctypes.byref(saved), None)


class Engine:
    """A loaded model: ``run`` turns images as clients send them into the output blob."""

    backend: ClassVar[str] = ""
    #: Builds from farm's ONNX export (``onnx_file``) rather than the Caffe weights, and
    #: takes uint8 images as they are, the preprocessing folded into the graph (``feed``).
    reads_onnx: ClassVar[bool] = False

    def __init__(
        self,
        spec: ModelSpec,
        network: Network,
        batch: int | None,
        device: str,
        threads: int | None,
        precision: str = defaults.PRECISION,
    ) -> None:
        self.spec = spec
        self.network = network
        self.batch = max(1, batch or spec.batch)
        self.device = device
        self.threads = threads
        self.precision = precision
        self.calibration = ""  # int8: the start of the calibration digest it must have
        self.transform = Transformer.for_model(spec)
        self.output_shape: tuple[int, ...] = ()
        self.allocated = 0  # the largest batch the buffers were sized for since the last rest
        self.last_run = RunStats()  # the latest ``run``'s device and copy seconds
        self.graphs: dict[bool, Any] = {}  # ONNX backends: folded or not -> the compiled net

    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        batch: int | None = None,
        device: str = "cpu",
        threads: int | None = None,
        precision: str = defaults.PRECISION,
        calibration: str = "",
    ) -> Engine:
        """Refuse a device or precision this backend lacks (before any model file is read),
        check the files, build the net in this backend, probe the output with one image.
        ``calibration``: in int8, the start of the calibration digest the version must have
        (the one the precision gate judged); empty: the model's current one."""
        cls.refuse(spec, device, precision)
        prepare(spec)
        # a backend that reads a cached export needs the net's shapes, not its weights again
        cached = cls.reads_onnx and onnx_path(spec, folded=True).is_file()
        weights = None if cached else spec.weights
        try:
            network = Network.load(spec.prototxt, weights, spec.declared_input)
        except NetworkError as exc:
            raise ModelError(f"model {spec.name!r}: {exc}") from None
        started = time.perf_counter()
        engine = cls(spec, network, batch, device, threads, precision)
        engine.calibration = calibration
        try:
            engine.build()
            network.drop_weights()  # the backend holds its own copy: keep one, not two
            release_free_memory()
            probe = engine.forward(engine.feed(np.zeros((1, *spec.item_shape), np.uint8)))
        except ModelError:
            raise
        except Exception as exc:  # the library's own error types: cv2.error, RuntimeError, ...
            raise ModelError(
                f"model {spec.name!r}: the {cls.backend} backend cannot run it: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        engine.output_shape = probe.shape[1:]
        engine.allocated = 1
        log.debug(
            "%s: %s built in %.3f s, output %s",
            cls.backend,
            spec.name,
            time.perf_counter() - started,
            engine.output_shape,
        )
        return engine

    @classmethod
    def refuse(cls, spec: ModelSpec, device: str, precision: str) -> None:
        """ModelError when this backend cannot compute in ``precision`` on ``device``:
        decided from the device and the libraries alone, before a model file is parsed
        or exported (``auto`` tries every backend on a GPU, and most refuse it)."""
        if precision not in PRECISIONS:
            raise ModelError(
                f"unknown precision {precision!r} for one engine; use one of "
                f"{', '.join(PRECISIONS)} (a cascade loads two: farm.engines.cascade)"
            )
        offered = cls.precisions(spec, device)
        if precision not in offered:
            listed = f"it offers {', '.join(offered)}" if offered else "it offers none there"
            raise ModelError(
                f"the {cls.backend} backend does not compute in {precision} on "
                f"{device}{cls.precision_note(spec, device)}; {listed}"
            )

    def build(self) -> None:
        """Construct the backend's net from ``self.network``."""
        raise NotImplementedError

    @classmethod
    def precisions(cls, spec: ModelSpec, device: str) -> tuple[str, ...]:
        """The precisions this backend computes in on ``device`` (none: it cannot run
        there); cheap: no model file is read."""
        return ("f32",) if device == "cpu" else ()

    @classmethod
    def precision_note(cls, spec: ModelSpec, device: str) -> str:
        """Why a precision is missing there (``" (this CPU lacks bf16)"``), or nothing."""
        return "" if device == "cpu" else f" (farm runs {cls.backend} on CPUs only)"

    def describe(self) -> str:
        """The engine as logs and ``farm status`` show it: ``openvino f32 batch 64``."""
        return f"{self.backend} {self.precision} batch {self.batch}"

    def onnx_file(self, folded: bool = False) -> str:
        """farm's ONNX export of the net (see ``exported_onnx``); in int8, the model's
        quantized version, which takes uint8 images."""
        if self.precision != "int8":
            return str(exported_onnx(self.spec, self.network, folded))
        if not folded:
            raise ModelError(
                f"model {self.spec.name!r}: int8 runs on uint8 images (its calibration's); "
                f"send uint8 images or run float32 ones in another precision"
            )
        return str(quantize.quantized_file(self.spec, self.calibration))

    @classmethod
    def int8_offered(cls, spec: ModelSpec, device: str) -> bool:
        """Whether an int8 version of the model is here (an ONNX backend on the CPU runs it)."""
        return cls.reads_onnx and device == "cpu" and quantize.recorded(spec) is not None

    def graph(self, folded: bool) -> Any:
        """An ONNX backend's compiled net, compiled on first use: ``folded``, the export
        taking uint8 images with the preprocessing in the graph, else the plain export
        taking the host's float32 batches."""
        if folded not in self.graphs:
            self.graphs[folded] = self.compile(self.onnx_file(folded))
        return self.graphs[folded]

    def compile(self, path: str) -> Any:
        """An ONNX backend's net compiled from the export at ``path``."""
        raise NotImplementedError

    def clean_prototxt(self, folder: str) -> str:
        """Write ``self.network`` as a clean deploy prototxt into ``folder``; its path."""
        path = os.path.join(folder, "deploy.prototxt")
        with open(path, "w") as handle:
            handle.write(self.network.deploy_text())
        return path

    def folds(self, dtype: np.dtype) -> bool:
        """The one place deciding where the preprocessing runs: in the graph for uint8
        images on a backend that runs farm's ONNX export, else on the host."""
        return self.reads_onnx and dtype == np.uint8

    def feed(self, images: np.ndarray) -> np.ndarray:
        """What ``forward`` takes for images as clients send them: uint8 ones as they are
        where the engine ``folds`` the preprocessing, else the host ``Transformer``'s
        float32 batch, exactly as before."""
        return images if self.folds(images.dtype) else self.transform(images)

    def prepare(self, dtype: np.dtype) -> float:
        """Compile now the graph that images of ``dtype`` run on, if not yet (a worker counts
        it as loading, not computing); the seconds it took (0 when there was none to do)."""
        folded = self.folds(dtype)
        if not self.reads_onnx or folded in self.graphs:
            return 0.0
        started = time.perf_counter()
        self.graph(folded)
        return time.perf_counter() - started

    def forward(self, batch: np.ndarray) -> np.ndarray:
        """The output blob for one batch as ``feed`` makes it."""
        raise NotImplementedError

    def shrink(self) -> None:
        """Resize the backend's buffers to the net's resting batch."""

    def run(
        self,
        images: np.ndarray,
        stop: Callable[[], bool] | None = None,
        tally: Callable[[int, float], None] | None = None,
        then: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Outputs for ``images`` (N x item shape, uint8 or float32), in compute batches.

        Batches larger than the prototxt's own batch grow the net; ``rest`` shrinks it
        back (a worker does so when it falls idle, not between chunks: reshaping a net
        costs more than a chunk of LeNet).  ``stop`` is asked before each batch; when it
        says yes, ``Stopped`` is raised (a cancelled job).  ``tally`` hears each batch's
        images and seconds as it finishes (the worker's live counters).  ``then`` is for
        engines that ``feeds_ahead``: the others compute each batch at once, and ignore it.
        """
        count = images.shape[0]
        outputs = np.empty((count, *self.output_shape), dtype=np.float32)
        self.last_run = stats = RunStats()
        for begin in range(0, count, self.batch):
            if stop is not None and stop():
                raise Stopped(f"stopped after {begin} of {count} images")
            end = min(begin + self.batch, count)
            started = time.perf_counter()
            outputs[begin:end] = self.forward(self.feed(images[begin:end]))
            seconds = time.perf_counter() - started
            stats.device += seconds
            if tally is not None:
                tally(end - begin, seconds)
            self.allocated = max(self.allocated, end - begin)
        return outputs

    @property
    def feeds_ahead(self) -> bool:
        """Whether ``start_ahead`` can launch a chunk while the one before it computes
        (a GPU's engine: the device works while the host waits); if so, ``run`` calls its
        ``then`` once the chunk's batches are launched, before waiting for the last."""
        return False

    def start_ahead(self, images: np.ndarray, stop: Callable[[], bool] | None = None) -> None:
        """Launch the first batches of the next chunk (``images``), whose ``run`` follows."""
        raise NotImplementedError(f"the {self.backend} engine does not feed ahead")

    @property
    def grown(self) -> bool:
        """Whether the net holds buffers for more than its resting batch."""
        return self.allocated > self.spec.batch

    def rest(self) -> None:
        """Shrink to the resting batch and return the freed memory to the OS."""
        self.shrink()
        self.allocated = self.spec.batch
        release_free_memory()


def require_onnx_engine(backend: str, module: str, library: str, hint: str) -> None:
    """Import an engine that runs farm's ONNX export; BackendUnavailable naming what to
    install.  ``onnx`` is only looked up: a cached export needs no onnx."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailable(f"the {backend} backend needs {library} ({exc}): {hint}") from exc
    if importlib.util.find_spec("onnx") is None:
        raise BackendUnavailable(
            f"the {backend} backend needs the onnx package for farm's export: {hint}"
        )


def engine_class(backend: str) -> type[Engine]:
    """The engine class of a named backend (``auto`` is ``autoselect.load_engine``'s);
    BackendUnavailable says how to get its library."""
    if backend not in BACKENDS:
        raise ModelError(f"unknown backend {backend!r}; use {AUTO} or one of {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[backend].split(":")
    module = importlib.import_module(module_name)
    module.require()
    return getattr(module, class_name)


def available_backends() -> dict[str, str | None]:
    """Backend -> None when usable here, else why not."""
    problems: dict[str, str | None] = {}
    for name in BACKENDS:
        try:
            engine_class(name)
            problems[name] = None
        except BackendUnavailable as exc:
            problems[name] = str(exc)
    return problems
