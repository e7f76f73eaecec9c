"""The broker's model repository: specs and manifests by name, hashed again only when files
change."""

from __future__ import annotations

from dataclasses import dataclass, field

from farm.modelrepo.caffe_net import Network, NetworkError
from farm.modelrepo.modelstore import Manifest, manifest_of
from farm.modelrepo.repository import ModelError, ModelSpec, find, prepare


@dataclass
class ModelCatalog:
    """Models the broker can hand to workers: its folders, ``$FARM_MODELS``, the bundled ones."""

    model_dirs: tuple[str, ...] = ()
    outputs: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # by digest

    def lookup(self, name: str) -> tuple[ModelSpec, Manifest]:
        """The model's spec and manifest; ModelError names the known models or the broken file."""
        spec = find(name, self.model_dirs)
        try:
            prepare(spec)  # generated weights are made here, once, and served from here
            return spec, manifest_of(spec)
        except OSError as exc:
            raise ModelError(f"model {name!r}: {exc}") from exc

    def output_shape(self, spec: ModelSpec, digest: str) -> tuple[int, ...] | None:
        """One image's outputs, inferred from the net's own layers (no weights read), so
        that no worker's answer sets it; None if the shape rules cannot tell."""
        if digest not in self.outputs:
            try:
                net = Network.load(spec.prototxt, input_shape=spec.declared_input)
                self.outputs[digest] = tuple(net.shapes[spec.output][1:])
            except (NetworkError, KeyError, OSError):
                self.outputs[digest] = None
        return self.outputs[digest]
