"""The broker's model repository: specs and manifests by name, hashed again only when files
change."""

from __future__ import annotations

from dataclasses import dataclass

from farm.modelrepo.modelstore import Manifest, manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, find, prepare


@dataclass
class ModelCatalog:
    """Models the broker can hand to workers: its folders, ``$FARM_MODELS``, the bundled ones."""

    model_dirs: tuple[str, ...] = ()

    def lookup(self, name: str) -> tuple[ModelSpec, Manifest]:
        """The model's spec and manifest; ModelError names the known models or the broken file."""
        spec = find(name, self.model_dirs)
        try:
            prepare(spec)  # generated weights are made here, once, and served from here
            return spec, manifest_of(spec)
        except OSError as exc:
            raise ModelError(f"model {name!r}: {exc}") from exc
