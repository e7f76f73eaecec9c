"""Fixtures and helpers of both tiers: the bundled LeNet and its sample, a reference forward,
bench scripts as modules, and a model cache of the run's own.  Farms (real processes) are
``tests/system/conftest.py``'s."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from farm.modelrepo.repository import ModelSpec, find

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: Python lines for a test's subprocess: its address space capped at what it uses now plus
#: 256 MiB, so that LeNet at batch 8192 (377 MB for conv1) really runs out of memory.
LIMIT_ADDRESS_SPACE = """
import resource
with open("/proc/self/status") as handle:
    size = next(int(line.split()[1]) for line in handle if line.startswith("VmSize:"))
room = (size + 256 * 1024) * 1024
resource.setrlimit(resource.RLIMIT_AS, (room, room))
"""


def bench_script(name: str) -> ModuleType:
    """A script of bench/ imported as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def available_bundled() -> list[str]:
    """The names of the models bundled with farm, whatever else this machine's user has."""
    from farm.modelrepo.repository import BUNDLED_DIR

    return [folder.name for folder in BUNDLED_DIR.iterdir() if (folder / "model.toml").is_file()]


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory) -> None:
    """Fetched models and generated weights go to a fresh folder, not the user's ~/.cache, the
    user's own model repository (~/.local/share/farm/models) is left out, and so is a farm
    the user started with ``farm up`` (``farm run`` would use it)."""
    os.environ["FARM_CACHE"] = str(tmp_path_factory.mktemp("farm-cache"))
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("data"))  # no user models
    os.environ["FARM_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("runtime"))


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A test's own $FARM_CACHE: int8 versions, verdicts and exports do not leak between
    tests."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FARM_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def lenet() -> ModelSpec:
    return find("lenet")


@pytest.fixture(scope="session")
def digits(lenet: ModelSpec) -> np.ndarray:
    """The bundled sample: N x H x W uint8."""
    return np.load(lenet.sample)


def reference_forward(spec: ModelSpec, images: np.ndarray) -> np.ndarray:
    """OpenCV run in-process on the whole array at once: what the farm must reproduce."""
    import cv2

    net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
    batch = images if images.ndim == 4 else images[:, None]
    net.setInput(batch.astype(np.float32), spec.input, spec.input_scale)
    return net.forward(spec.output).copy()
