"""A worker's model files: its own folders, its cache, and the files it asks the broker for.

A TASK names its model and the model's digest.  A worker runs it from a local folder or
cached copy with that digest, else it asks the broker for the files (FETCH) and parks
the task, and every later one for that model, until the MODEL arrives.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.modelrepo.modelstore import Manifest, ModelCache, manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, available, load_spec
from farm.wire import messages, protocol
from farm.wire.protocol import Command, Message
from farm.workers.config import WorkerConfig

log = logging.getLogger("farm.worker")

#: Seconds a chunk waits for its model's files before it is reported FAILED.
FETCH_TIMEOUT = 120.0

Reply = list[Any]
Parked = list[tuple[Message, float]]  # TASK messages and when each was received


@dataclass
class ModelFetches:
    """Where a worker finds a model's files, and the chunks parked on a FETCH (compute
    thread)."""

    config: WorkerConfig
    waiting: dict[str, Parked] = field(default_factory=dict)  # by model digest
    fetch_sent: dict[str, float] = field(default_factory=dict)  # digest -> when FETCH went out
    fetched: dict[str, int] = field(default_factory=dict)  # model -> times fetched
    # --model names this host lacks: asked of the broker by name on every new connection
    # until it answers
    preloading: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        folder = self.config.cache_dir
        self.cache = ModelCache(Path(folder)) if folder else ModelCache.default()

    def local_models(self) -> dict[str, ModelSpec]:
        """Models in this host's repository folders, by name (broken ones skipped)."""
        specs = {}
        for name, folder in available(self.config.model_dirs).items():
            try:
                specs[name] = load_spec(folder)
            except ModelError as exc:
                log.warning("skipping model %s: %s", name, exc)
        return specs

    def find_files(self, model: str, digest: str) -> ModelSpec | None:
        """A local or cached copy of the model with exactly this digest, if there is one."""
        folder = available(self.config.model_dirs).get(model)
        if folder is not None:
            try:
                spec = load_spec(folder)
                # generated weights not made here yet: fetch them rather than remake them
                if spec.weights.is_file() and manifest_of(spec).digest == digest:
                    return spec
            except (ModelError, OSError) as exc:
                log.warning("local model %s unusable: %s", model, exc)
        return self.cache.lookup(model, digest)

    def fetch(self, message: Message, task: messages.Task, received: float) -> Reply:
        """Park a chunk whose model's files are not here; the FETCH that asks for them."""
        self.waiting[task.digest] = [(message, received)]
        self.fetch_sent[task.digest] = time.monotonic()
        log.info("fetching model %s (%s) from the broker", task.model, task.digest[:12])
        return protocol.encode(Command.FETCH, messages.Fetch(model=task.model, digest=task.digest))

    def preload_fetches(self) -> list[Reply]:
        """FETCH by name (empty digest: the broker's current copy) for each ``--model`` model
        still missing."""
        return [
            protocol.encode(Command.FETCH, messages.Fetch(model=name, digest=""))
            for name in sorted(self.preloading)
        ]

    def arrived(self, digest: str) -> Parked:
        """A MODEL answered the FETCH for ``digest``: the chunks parked on it."""
        self.fetch_sent.pop(digest, None)
        return self.waiting.pop(digest, [])

    def install(self, message: Message, header: messages.Model) -> tuple[ModelSpec, Manifest]:
        """Check a MODEL's files and cache them; ModelError if the broker sent none, or bad
        ones."""
        if header.error is not None:
            raise ModelError(f"the broker cannot send model {header.model!r}: {header.error}")
        manifest = Manifest.from_header(header)
        spec = self.cache.install(manifest, message.payload)
        self.fetched[manifest.model] = self.fetched.get(manifest.model, 0) + 1
        return spec, manifest

    def expired(self) -> Parked:
        """The chunks parked on a FETCH the broker has not answered in time."""
        now, parked = time.monotonic(), []
        for digest, sent in list(self.fetch_sent.items()):
            if now - sent > FETCH_TIMEOUT:
                del self.fetch_sent[digest]
                parked += self.waiting.pop(digest, [])
        return parked

    def forget(self) -> None:
        """A new connection: the old one's fetches died with it."""
        self.waiting.clear()
        self.fetch_sent.clear()
