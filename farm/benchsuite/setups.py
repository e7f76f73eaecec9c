"""What the benchmark runs on: this machine, the farms it builds here, the images."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from dataclasses import dataclass
from typing import Any

import numpy as np

from farm.engines.cpu import cpu_info
from farm.engines.engine import AUTO, available_backends
from farm.modelrepo.repository import find
from farm.ops.deploy import Layout
from farm.ops.local import cores


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of a benchmark farm: its device and, when not the default (auto), its
    backend."""

    device: str  # cpu:N or gpu:N
    backend: str | None = None
    batch: int | None = None  # compute batch; None: the model's prototxt batch

    @property
    def library(self) -> str:
        """The backend it runs: a worker given none runs ``auto`` (the fastest that agrees,
        chosen when it loads the model), as every worker does by default."""
        return self.backend or AUTO

    @property
    def kind(self) -> str:
        """The device kind of the paper's Table 2: 'cpu core (auto)', 'cpu core (torch)'."""
        device = "gpu" if self.device.startswith("gpu") else "cpu core"
        return f"{device} ({self.library})"

    @property
    def label(self) -> str:
        return f"{self.device}/{self.library}"

    @classmethod
    def from_label(cls, label: str) -> WorkerSpec:
        device, _, library = label.partition("/")
        return cls(device, library or None)

    def options(self) -> list[str]:
        backend = ["--backend", self.backend] if self.backend else []
        return backend + (["--batch", str(self.batch)] if self.batch else [])

    def with_batch(self, batch: int | None) -> WorkerSpec:
        return WorkerSpec(self.device, self.backend, batch)


@dataclass(frozen=True)
class FarmSetup:
    """A farm the suite builds: a name, a sentence on why, its workers."""

    name: str
    about: str
    workers: tuple[WorkerSpec, ...]

    def with_batches(self, batches: dict[str, int]) -> FarmSetup:
        """The same farm, each worker at the batch of its kind in ``batches``."""
        return FarmSetup(
            self.name,
            self.about,
            tuple(worker.with_batch(batches.get(worker.kind)) for worker in self.workers),
        )


SETUP_NAMES = ("cores", "mixed", "gpu")
SETUP_ABOUT = {
    "cores": "one pinned single-thread worker per core, on the backend auto picks "
    "(the default farm)",
    "mixed": "pinned single-thread workers, OpenCV and torch on alternate cores (unequal speeds)",
    "gpu": "one worker per GPU and one pinned worker per core but those kept to feed the "
    "GPUs, each on the backend auto picks",
}


def gpu_names() -> list[str]:
    """The CUDA devices torch sees here (none without torch or a GPU)."""
    if available_backends().get("torch") is not None:
        return []
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def farm_setups(wanted: tuple[str, ...] = SETUP_NAMES) -> tuple[list[FarmSetup], list[str]]:
    """The farms this machine can build among ``wanted``, and why the others were skipped."""
    here = cores()
    default = tuple(WorkerSpec(f"cpu:{core}") for core in here)
    built: list[FarmSetup] = []
    skipped: list[str] = []
    torch_problem = available_backends().get("torch")
    if "cores" in wanted:
        built.append(FarmSetup("cores", SETUP_ABOUT["cores"], default))
    if "mixed" in wanted:
        if torch_problem is not None:
            skipped.append(f"mixed: {torch_problem}")
        elif len(here) < 2:
            skipped.append("mixed: needs two cores")
        else:
            mixed = tuple(
                WorkerSpec(f"cpu:{core}", "torch" if i % 2 else "opencv")
                for i, core in enumerate(here)
            )
            built.append(FarmSetup("mixed", SETUP_ABOUT["mixed"], mixed))
    if "gpu" in wanted:
        gpus = gpu_names()
        if not gpus:
            skipped.append(
                "gpu: no CUDA device "
                + ("(torch is not installed)" if torch_problem else "visible to torch")
            )
        else:  # a core per GPU feeds it, as farm deploy supervisord lays it out
            layout = Layout.plan(tuple(here), tuple(range(len(gpus))))
            workers = tuple(WorkerSpec(f"cpu:{core}") for core in layout.cpu_cores) + tuple(
                WorkerSpec(f"gpu:{gpu}") for gpu, _ in layout.gpus
            )
            built.append(FarmSetup("gpu", SETUP_ABOUT["gpu"], workers))
    return built, skipped


def make_images(model: str, count: int) -> np.ndarray:
    """``count`` images for ``model``: its bundled sample, repeated, or for a model with
    none (the ImageNet nets, whose weights are seeded), uint8 pixels from a fixed seed;
    either way the same on every call."""
    spec = find(model)
    if spec.sample is None:
        pixels = np.random.default_rng(0).integers(
            0, 256, (min(count, 64), *spec.item_shape), dtype=np.uint8
        )
        return np.resize(pixels, (count, *spec.item_shape))
    return np.resize(np.load(spec.sample), (count, *spec.item_shape))


def package_version(package: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


#: The instruction sets the engines' kernels use, as /proc/cpuinfo names them.
NOTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def amd_generation(vendor: str, family: int, model: int) -> str:
    """AMD's Zen generation of a CPU family and model ("" for another vendor or one not
    listed): family 25 (19h) is Zen 3 or Zen 4 by model, 26 (1Ah) Zen 5."""
    if vendor != "AuthenticAMD":
        return ""
    if family == 26:
        return "Zen 5"
    if family == 25:  # Genoa 1xh, Raphael 6xh, Phoenix 7xh, Bergamo Axh
        return "Zen 4" if model >> 4 in (0x1, 0x6, 0x7, 0xA) else "Zen 3"
    return "Zen to Zen 2" if family == 23 else ""


def cpu_description() -> dict[str, Any]:
    """The CPU's name, family, model, generation and noted instruction sets."""
    info = cpu_info()
    family, model = int(info.get("cpu family", "0")), int(info.get("model", "0"))
    flags = set(info.get("flags", "").split())
    return {
        "cpu": info.get("model name", "unknown CPU"),
        "cpu_family": family,
        "cpu_model": model,
        "cpu_generation": amd_generation(info.get("vendor_id", ""), family, model),
        "cpu_flags": [flag for flag in NOTED_FLAGS if flag in flags],
    }


def describe_machine() -> dict[str, Any]:
    """Date, CPU, memory, GPUs and library versions, for the report's first lines."""
    with open("/proc/meminfo") as handle:
        memory = int(handle.readline().split()[1]) / 1024**2
    return {
        "date": datetime.date.today().isoformat(),
        **cpu_description(),
        "cores": len(cores()),
        "memory_gib": round(memory, 1),
        "gpus": gpu_names(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            name: package_version(name)
            for name in (
                "farm",
                "opencv-python-headless",
                "torch",
                "onnxruntime",
                "openvino",
                "onnx",
                "numpy",
                "pyzmq",
                "ray",
            )
        },
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }


def machine_slug(machine: dict[str, Any]) -> str:
    """A folder name: date, cores, GPU or not."""
    gpus = machine["gpus"]
    tail = f"{len(gpus)}gpu" if gpus else "cpu"
    return f"{machine['date']}-{machine['cores']}cores-{tail}"
