"""The model repository: one folder per model with its Caffe files and a ``model.toml``."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

#: Models bundled with the package.
BUNDLED_DIR = Path(__file__).parent / "models"


class ModelError(LookupError):
    """A model is unknown or its files are broken."""


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to load and feed a model."""

    name: str
    folder: Path
    prototxt: Path
    weights: Path
    input: str
    input_shape: tuple[int, ...]
    output: str
    input_scale: float = 1.0
    description: str = ""
    labels: tuple[str, ...] = field(default_factory=tuple)
    sample: Path | None = None

    def summary(self) -> dict[str, Any]:
        """What a worker advertises about the model to the broker."""
        return {"input_shape": list(self.input_shape)}


def search_path(extra: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Model folders to search: explicit ones, then ``$FARM_MODELS``, then the bundled ones."""
    env = [p for p in os.environ.get("FARM_MODELS", "").split(os.pathsep) if p]
    return [Path(p) for p in (*extra, *env)] + [BUNDLED_DIR]


def load_spec(folder: Path) -> ModelSpec:
    """Read ``folder/model.toml``; raise ModelError when it or a file it names is missing."""
    config_path = folder / "model.toml"
    try:
        config = tomllib.loads(config_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelError(f"cannot read {config_path}: {exc}") from exc
    try:
        spec = ModelSpec(
            name=folder.name, folder=folder,
            prototxt=folder / config["prototxt"], weights=folder / config["weights"],
            input=config["input"], input_shape=tuple(config["input_shape"]),
            output=config["output"], input_scale=float(config.get("input_scale", 1.0)),
            description=config.get("description", ""), labels=tuple(config.get("labels", ())),
            sample=folder / config["sample"] if "sample" in config else None)
    except KeyError as exc:
        raise ModelError(f"{config_path} lacks the key {exc}") from None
    for path in (spec.prototxt, spec.weights):
        if not path.is_file():
            raise ModelError(f"model {spec.name!r}: file {path} is missing")
    return spec


def available(extra: Sequence[str | os.PathLike] = ()) -> dict[str, Path]:
    """Model name -> folder, the first folder on the search path winning."""
    found: dict[str, Path] = {}
    for root in search_path(extra):
        if not root.is_dir():
            continue
        for folder in sorted(root.iterdir()):
            if (folder / "model.toml").is_file():
                found.setdefault(folder.name, folder)
    return found


def find(name: str, extra: Sequence[str | os.PathLike] = ()) -> ModelSpec:
    """The spec of a model by name; raise ModelError naming the known ones."""
    models = available(extra)
    if name not in models:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(models)) or 'none'}")
    return load_spec(models[name])
