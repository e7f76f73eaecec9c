"""The ONNX Runtime backend: farm's own ONNX export of the net, on the CPU or on CUDA.

A pinned worker gets one intra-op thread and sequential execution; an
unpinned one, ONNX Runtime's own thread pool.  uint8 images run on the export
with the preprocessing folded in (a session made at load); float32 ones on the
plain export (a session made on their first batch).  On the CPU, int8 runs the
model's quantized version (``farm.engines.quantize``).  On a GPU worker the TensorRT
execution provider is tried first, then CUDA, when ``onnxruntime-gpu`` offers
them; TensorRT also computes in f16 when asked.

TensorRT's engines are cached in ``$FARM_CACHE/tensorrt``, a folder per digest of the
ONNX file, so an engine is only ever reused for the graph it was built from.  farm does
not check the engines' own bytes: ONNX Runtime writes them when a batch first needs one
(a larger batch rebuilds it, mid-job), not when farm could record them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from farm.engines.engine import Engine, require_onnx_engine
from farm.modelrepo import sealed
from farm.modelrepo.repository import ModelError, ModelSpec, cache_root

INSTALL_HINT = "pip install onnxruntime onnx (on GPUs: pip install onnxruntime-gpu onnx)"


def require() -> None:
    require_onnx_engine("onnxruntime", "onnxruntime", "ONNX Runtime", INSTALL_HINT)


def gpu_providers() -> list[str]:
    """The GPU execution providers this ONNX Runtime build offers, best first."""
    import onnxruntime

    offered = onnxruntime.get_available_providers()
    return [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in offered]


class OnnxRuntimeEngine(Engine):
    backend = "onnxruntime"
    reads_onnx = True

    @classmethod
    def precisions(cls, spec: ModelSpec, device: str) -> tuple[str, ...]:
        if device.startswith("cuda"):
            offered = gpu_providers()
            if not offered:
                return ()
            return ("f32", "f16") if "TensorrtExecutionProvider" in offered else ("f32",)
        return ("f32", "int8") if cls.int8_offered(spec, device) else ("f32",)

    @classmethod
    def precision_note(cls, spec: ModelSpec, device: str) -> str:
        if device.startswith("cuda"):
            if not gpu_providers():
                return (
                    " (this ONNX Runtime offers no CUDA execution provider: "
                    "pip install onnxruntime-gpu)"
                )
            return ""
        return " (ONNX Runtime's CPU runs f32, and int8 after `farm models quantize`)"

    def build(self) -> None:
        self.graph(folded=True)  # uint8 images, the common input; float32 builds on demand

    def compile(self, path: str) -> Any:
        """A session on the export at ``path``: one inter-op thread, this worker's intra-op
        threads, this device's providers."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
        options.log_severity_level = 3  # warnings about unused initializers are noise here
        session = onnxruntime.InferenceSession(path, options, providers=self.providers(path))
        self.input_name = session.get_inputs()[0].name  # the same in both graphs
        self.output_name = session.get_outputs()[0].name
        return session

    def providers(self, path: str) -> list[object]:
        """This device's execution providers for the export at ``path``."""
        if not self.device.startswith("cuda"):
            return ["CPUExecutionProvider"]
        index = int(self.device.partition(":")[2] or 0)
        offered = gpu_providers()
        if not offered:
            raise ModelError(
                f"device {self.device}: this ONNX Runtime offers no CUDA execution "
                f"provider (pip install onnxruntime-gpu)"
            )
        chosen: list[object] = []
        if "TensorrtExecutionProvider" in offered:
            engines = cache_root() / "tensorrt" / sealed.sha256_of(Path(path))[:24]
            engines.mkdir(parents=True, exist_ok=True)
            chosen.append(
                (
                    "TensorrtExecutionProvider",
                    {
                        "device_id": index,
                        "trt_fp16_enable": self.precision == "f16",
                        "trt_engine_cache_enable": True,
                        "trt_engine_cache_path": str(engines),
                    },
                )
            )
        if "CUDAExecutionProvider" in offered:
            chosen.append(("CUDAExecutionProvider", {"device_id": index}))
        return chosen

    def forward(self, batch: np.ndarray) -> np.ndarray:
        session = self.graph(self.folds(batch.dtype))
        return session.run([self.output_name], {self.input_name: batch})[0]
