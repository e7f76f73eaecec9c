"""A few images of an input, decoded as the workers decode them: the calibration set of
``farm models quantize`` and the validation set of the precision gate (``--precision
auto``).  Any input a job takes serves: folders, globs, lists of image files, or a
`.npy` array of uint8 images."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from farm.client.inputs import ArraySource, FileSource, InputError, Source, open_input
from farm.engines.images import ImageDecoder
from farm.modelrepo.repository import ModelSpec
from farm.wire.shapes import fitted_shape


@dataclass
class Sample:
    """Images ready for the model (uint8, its item shape), from where, and the reasons
    of the files that could not be decoded."""

    images: np.ndarray
    label: str
    skipped: list[str]
    kept: np.ndarray  # the indices, among the first ``count`` items, of those decoded

    def describe(self) -> str:
        skipped = f" ({len(self.skipped)} files could not be decoded)" if self.skipped else ""
        return f"{len(self.images)} images of {self.label}{skipped}"


def sample_of(arguments: Sequence[str], spec: ModelSpec, count: int) -> Sample:
    """The first ``count`` images of the input ``arguments`` names (fewer if it has fewer);
    InputError when they are not uint8 images of the model's shape."""
    return first_images(open_input(arguments), spec, count, " ".join(arguments))


def input_key(
    source: Source, count: int, labels: np.ndarray | None = None, exif_rotate: bool = True
) -> str:
    """What names the first ``count`` images of ``source`` without decoding them: each
    file's path, size and modification time (and whether EXIF turns them), or an array's
    rows (and the labels)."""
    hasher = hashlib.sha256(f"{count}".encode())
    if not exif_rotate and isinstance(source, FileSource):
        hasher.update(b"stored pixels\n")
    if isinstance(source, ArraySource):
        hasher.update(np.ascontiguousarray(source.read(0, min(count, len(source)))).data)
    else:
        for path in source.paths[:count]:
            try:
                stat = path.stat()
                hasher.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            except OSError:
                hasher.update(f"{path}\0unreadable\n".encode())
    if labels is not None:
        hasher.update(np.ascontiguousarray(labels).data)
    return hasher.hexdigest()


def first_images(
    source: Source, spec: ModelSpec, count: int, label: str, exif_rotate: bool = True
) -> Sample:
    """The first ``count`` images of a job's ``source``, as the workers will see them
    (image files turned upright by their EXIF orientation unless ``exif_rotate`` is off)."""
    if isinstance(source, ArraySource):
        images = array_images(source, spec, count)
        return Sample(images, label, [], np.arange(len(images)))
    return decoded_files(source, spec, count, label, exif_rotate)


def array_images(source: ArraySource, spec: ModelSpec, count: int) -> np.ndarray:
    if source.wire != np.uint8:
        raise InputError(
            f"{source.label}: lower precisions are calibrated and checked on uint8 images, "
            f"not {source.wire.name}"
        )
    fitted = fitted_shape(tuple(spec.item_shape), spec.preprocess.layout, source.item_shape)
    if fitted is None:
        raise InputError(
            f"{source.label}: images of shape {source.item_shape}, the model "
            f"{spec.name!r} takes {tuple(spec.item_shape)}"
        )
    images = source.read(0, min(count, len(source)))
    return images.reshape(len(images), *fitted)  # 1-channel: the same bytes, its layout


def decoded_files(
    source: FileSource, spec: ModelSpec, count: int, label: str, exif_rotate: bool = True
) -> Sample:
    """The first ``count`` image files decoded, in order; a file that fails is left out,
    with its reason."""
    decoder = ImageDecoder(spec)
    indices = range(min(count, len(source)))
    batch = decoder.decode([source.read_file(index) for index in indices], exif_rotate)
    skipped = [
        f"{source.paths[index]}: {source.problems.get(index) or reason}"
        for index, reason in batch.failures
    ]
    if not len(batch.ok):
        raise InputError(f"{label}: no image could be decoded ({'; '.join(skipped[:3])})")
    kept = np.repeat(batch.ok, batch.crops)  # an oversampled model: each file's crops
    return Sample(batch.images[:count], label, skipped, kept[:count])
