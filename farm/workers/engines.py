"""A worker's loaded engines: one per model digest and engine choice, loaded on first use."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from farm.engines.autoselect import load_chosen
from farm.engines.engine import Engine
from farm.modelrepo.repository import ModelError, ModelSpec
from farm.wire import messages
from farm.wire.engines import EngineChoice
from farm.workers.config import WorkerConfig

log = logging.getLogger("farm.worker")


class EngineKey(NamedTuple):
    """A loaded engine: the model's digest and the engine choice it was loaded for."""

    digest: str
    choice: EngineChoice


@dataclass
class LoadedEngines:
    """The engines a worker loaded, and why a key could not load (remembered and reported
    again).  ``own``: the engine of chunks whose job chose none."""

    config: WorkerConfig
    own: EngineChoice
    loaded: dict[EngineKey, Engine] = field(default_factory=dict)
    broken: dict[EngineKey, str] = field(default_factory=dict)

    @property
    def threads(self) -> int | None:
        """Compute threads: one on a pinned core, else the libraries' defaults."""
        return 1 if self.config.device.pinned else None

    def key(self, task: messages.Task) -> EngineKey:
        """The engine a TASK runs on: its job's choice, else this worker's."""
        return EngineKey(task.digest, task.engine or self.own)

    def load(self, spec: ModelSpec | None, key: EngineKey) -> Engine:
        """Load a model once per digest and engine; a failure is remembered and reported
        again."""
        if key in self.broken:
            raise ModelError(self.broken[key])
        if spec is None:
            raise ModelError(f"no files for model digest {key.digest[:12]}")
        if key not in self.loaded:
            try:
                self.loaded[key] = self.build(spec, key)
            except ModelError as exc:
                self.broken[key] = str(exc)
                raise
            described = self.loaded[key].describe()
            log.info("loaded model %s (%s): %s", spec.name, key.digest[:12], described)
        return self.loaded[key]

    def build(self, spec: ModelSpec, key: EngineKey) -> Engine:
        """The model on the key's choice of engine."""
        device = self.config.device.engine_device
        return load_chosen(spec, key.choice, self.config.batch, device, self.threads, key.digest)

    def names(self) -> dict[str, str]:
        """Model -> the engines running it (``openvino f32 batch 64``), for ``farm status``."""
        names: dict[str, list[str]] = {}
        for engine in list(self.loaded.values()):
            names.setdefault(engine.spec.name, []).append(engine.describe())
        return {model: " + ".join(described) for model, described in names.items()}

    def rest(self) -> None:
        """Idle: shrink every net that grew for large batches back to its resting batch."""
        for engine in list(self.loaded.values()):
            if engine.grown:
                engine.rest()
