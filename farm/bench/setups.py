"""What the benchmark runs on: this machine, the farms it builds here, the images."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from dataclasses import dataclass
from typing import Any

import numpy as np

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


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> dict[str, Any]:
    """Date, CPU, memory, GPUs and library versions, for the report's first lines."""
    model = "unknown CPU"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as handle:
        memory = int(handle.readline().split()[1]) / 1024**2
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": model,
        "cores": len(cores()),
        "memory_gib": round(memory, 1),
        "gpus": gpu_names(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            name: _version(name)
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
