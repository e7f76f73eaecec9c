"""The OpenVINO backend: farm's own ONNX export of the net, compiled for the CPU.

The graph keeps a free batch dimension (one compiled model serves every
batch size; on this project's nets it runs as fast as a static one).  uint8
images run on the export with the preprocessing folded in, compiled at load;
float32 ones on the plain export, compiled on their first batch.  A
pinned worker gets one inference thread and one stream, and OpenVINO's own
thread pinning is off (the process is already pinned).  f32 is the default;
bf16 and f16 are offered where the CPU lists them in its optimization
capabilities, int8 where the model has a quantized version (``farm.engines.quantize``).

The precision is always stated when the net is compiled: on a CPU that offers
bf16 (AVX512_BF16: AMD Zen 4 and later, Intel Sapphire Rapids and later),
OpenVINO's own default ``INFERENCE_PRECISION_HINT`` is bf16, not f32
(docs/precision.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from farm.engines.engine import Engine, kept_signal_stack, require_onnx_engine
from farm.modelrepo import sealed
from farm.modelrepo.repository import ModelError, ModelSpec, cache_root

INSTALL_HINT = "pip install openvino onnx"

#: farm's precision names -> the CPU capability that offers them.
CAPABILITIES = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}
#: What a compiled blob's record calls it, and its format (OpenVINO checks its own version
#: in the blob's header, and compiles again over a blob of another).
CACHED = "OpenVINO compiled blob"
BLOB_FORMAT = "openvino compiled blob"


def require() -> None:
    require_onnx_engine("openvino", "openvino", "OpenVINO", INSTALL_HINT)


def new_core() -> Any:
    """A fresh ``openvino.Core``: its CPU defaults are the machine's (bf16 on a bf16 CPU)."""
    import openvino

    return openvino.Core()


def cpu_capabilities() -> list[str]:
    return list(new_core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def blob_folder(onnx_file: str) -> Path:
    """OpenVINO's ``CACHE_DIR`` for one ONNX file: a folder per digest of its bytes, so a
    blob is only ever imported for the graph it was compiled from."""
    return cache_root() / "openvino" / sealed.sha256_of(Path(onnx_file))[:24]


def compiled_precision(compiled: Any) -> str:
    """The precision a compiled model computes in (OpenVINO's type names are farm's: f32,
    bf16, f16)."""
    return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())


class OpenVINOEngine(Engine):
    backend = "openvino"
    reads_onnx = True

    @classmethod
    def precisions(cls, spec: ModelSpec, device: str) -> tuple[str, ...]:
        if device != "cpu":
            return ()
        offered = cpu_capabilities()
        floats = tuple(
            name
            for name, capability in CAPABILITIES.items()
            if name == "f32" or capability in offered
        )
        return (*floats, "int8") if cls.int8_offered(spec, device) else floats

    @classmethod
    def precision_note(cls, spec: ModelSpec, device: str) -> str:
        if device != "cpu":
            return " (farm runs OpenVINO on CPUs only)"
        int8 = "" if cls.int8_offered(spec, device) else "; int8 needs `farm models quantize` first"
        return f" (this CPU offers {', '.join(cpu_capabilities())}{int8})"

    def build(self) -> None:
        self.graph(folded=True)  # uint8 images, the common input; float32 compiles on demand

    def compile(self, path: str) -> Any:
        """One infer request on the export at ``path``, compiled for this worker's threads.

        Compiled models are kept in OpenVINO's own cache (``CACHE_DIR``, a folder of farm's
        cache per digest of the ONNX file), keyed by OpenVINO on the file, the settings and
        its version: a worker that loads the same model again imports it in a fraction of
        the compile time.  A blob that cannot be read (cut short, another version) is
        compiled again.  OpenVINO does not check a blob's bytes (one flipped byte in a
        weight is imported as it is), so farm records each blob's digest after the
        compile and checks the folder before the next (``sealed.checked_folder``): a blob
        that differs is logged, removed and compiled again.  The folder is locked
        meanwhile, so workers starting together compile a graph once."""
        core = new_core()
        # int8: the quantized layers run in int8 as their QDQ nodes say, the others in f32
        floats = "f32" if self.precision == "int8" else self.precision
        folder = blob_folder(path)
        config: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": floats,  # never the CPU's default
            "CACHE_DIR": str(folder),
        }
        if self.threads is not None:
            config.update(
                {
                    "PERFORMANCE_HINT": "LATENCY",
                    "INFERENCE_NUM_THREADS": self.threads,
                    "NUM_STREAMS": 1,
                    "ENABLE_CPU_PINNING": False,
                }
            )
        with (
            sealed.checked_folder(folder, CACHED, BLOB_FORMAT),
            kept_signal_stack(),  # OpenVINO may leave the thread a signal stack it frees
        ):
            compiled = core.compile_model(path, "CPU", config)
        if (precision := compiled_precision(compiled)) != floats:
            raise ModelError(
                f"OpenVINO compiled the net in {precision}, not the {floats} asked for"
            )
        return compiled.create_infer_request()

    def forward(self, batch: np.ndarray) -> np.ndarray:
        request = self.graph(self.folds(batch.dtype))
        with kept_signal_stack():
            return request.infer({0: batch}, share_inputs=True)[0].copy()
