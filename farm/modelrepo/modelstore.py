"""Models by content hash: manifests the broker serves, and the cache where workers keep them.

A model's digest is the SHA-256 of its manifest (each file's name and SHA-256),
so two folders with the same files have the same digest wherever they are.
A job carries its model's digest; a worker runs a model only from files whose
hashes it has checked against that digest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.modelrepo.repository import ModelError, ModelSpec, cache_root, load_spec
from farm.wire.messages import Model

log = logging.getLogger("farm.modelrepo.modelstore")

#: What a model name and a digest may look like (they become cache folder names).
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DIGEST = re.compile(r"[0-9a-f]{64}")

#: (path, size, mtime_ns) -> sha256 hex: files are hashed again only when they change.
_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path, fresh: bool = False) -> str:
    """A file's SHA-256, remembered by path, size and mtime unless ``fresh`` (hash it again)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if fresh or key not in _HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def check_file_name(name: str) -> str:
    """A relative path whose parts are plain names (no '..', no absolute path); ModelError if
    not."""
    if not all(SAFE_NAME.fullmatch(part) for part in name.split("/")):
        raise ModelError(
            f"file name {name[:120]!r} is not allowed in a model: use letters, "
            f"digits, '.', '_' and '-' (and '/' between folders)"
        )
    return name


@dataclass(frozen=True)
class ManifestFile:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A model's files, sizes and hashes, and the digest over them."""

    model: str
    files: tuple[ManifestFile, ...]

    @property
    def digest(self) -> str:
        lines = "".join(f"{f.name}\0{f.sha256}\n" for f in sorted(self.files, key=lambda f: f.name))
        return hashlib.sha256(lines.encode()).hexdigest()

    def header(self) -> Model:
        """The MODEL header that sends these files."""
        return Model(
            model=self.model,
            digest=self.digest,
            files=[(f.name, f.size, f.sha256) for f in self.files],
        )

    @classmethod
    def from_header(cls, header: Model) -> Manifest:
        """Parse a MODEL header (its types already checked); ModelError if a name is unsafe or
        the files do not hash to the digest."""
        files = tuple(ManifestFile(name, size, sha) for name, size, sha in header.files)
        for f in files:
            check_file_name(f.name)
        manifest = cls(header.model, files)
        if manifest.digest != header.digest:
            raise ModelError(
                f"model {manifest.model!r}: the manifest's files hash to "
                f"{manifest.digest[:16]}, not the digest {header.digest!r}"
            )
        return manifest


def manifest_of(spec: ModelSpec, fresh: bool = False) -> Manifest:
    """The manifest of a model folder; OSError if a file is missing (see ``prepare``)."""
    return Manifest(
        spec.name,
        tuple(
            ManifestFile(check_file_name(name), path.stat().st_size, file_sha256(path, fresh))
            for name, path in spec.files().items()
        ),
    )


@dataclass
class ModelCache:
    """Fetched models on a worker's disk, one folder per (name, digest)."""

    root: Path

    @classmethod
    def default(cls) -> ModelCache:
        return cls(cache_root() / "models")

    def folder(self, model: str, digest: str) -> Path:
        """The cache folder of a model; ModelError for a name or digest that is not plain."""
        if not SAFE_NAME.fullmatch(model) or not DIGEST.fullmatch(digest):
            raise ModelError(
                f"refusing model name {model[:80]!r} / digest {digest[:80]!r}: "
                f"names are letters, digits, '.', '_' and '-', digests 64 hex"
            )
        return self.root / f"{model}-{digest[:24]}"

    def lookup(self, model: str, digest: str) -> ModelSpec | None:
        """The cached model with this digest, checked file by file; None if absent or damaged."""
        folder = self.folder(model, digest)
        if not (folder / "model.toml").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a leftover would block the install
            return None
        try:
            spec = load_spec(folder, model)
            if spec.generate_seed is not None or manifest_of(spec, fresh=True).digest != digest:
                raise ModelError(
                    f"model {model!r}: cached files in {folder} do not hash to {digest[:16]}"
                )
            return spec
        except (ModelError, OSError) as exc:
            log.warning("discarding a damaged cache entry: %s", exc)
            shutil.rmtree(folder, ignore_errors=True)
            return None

    def install(self, manifest: Manifest, contents: Sequence[Any]) -> ModelSpec:
        """Check received file contents against the manifest, then store them atomically."""
        if len(contents) != len(manifest.files):
            raise ModelError(
                f"model {manifest.model!r}: {len(contents)} files received, the "
                f"manifest lists {len(manifest.files)}"
            )
        for f, content in zip(manifest.files, contents):
            data = memoryview(content)
            actual = hashlib.sha256(data).hexdigest()
            if data.nbytes != f.size or actual != f.sha256:
                raise ModelError(
                    f"model {manifest.model!r}: file {f.name} from the broker has "
                    f"{data.nbytes} bytes and sha256 {actual[:16]}, the manifest "
                    f"says {f.size} bytes and {f.sha256[:16]}; not installed"
                )
        installed = self.lookup(manifest.model, manifest.digest)  # workers may share a cache
        if installed is not None:
            return installed
        target = self.folder(manifest.model, manifest.digest)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{manifest.model}-", dir=self.root))
            try:
                for f, content in zip(manifest.files, contents):
                    (staging / f.name).parent.mkdir(parents=True, exist_ok=True)
                    (staging / f.name).write_bytes(memoryview(content))
                try:
                    os.replace(staging, target)  # atomic; fails if another worker got there first
                except OSError:
                    log.info("model %s was cached by another worker meanwhile", manifest.model)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except OSError as exc:
            raise ModelError(
                f"model {manifest.model!r}: cannot store it in {self.root}: {exc}"
            ) from exc
        # model.toml may only name the files that came: they must hash to the digest again
        installed = self.lookup(manifest.model, manifest.digest)
        if installed is None:
            raise ModelError(
                f"model {manifest.model!r}: the files received do not make up "
                f"the model their manifest describes (see the log); not installed"
            )
        return installed
