"""Caffe's ``Transformer``: images as clients send them -> the net's float32 N x C x H x W input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm.modelrepo.caffe_proto import CaffeFormatError, read_blobproto
from farm.modelrepo.repository import ModelError, ModelSpec

#: The first bytes of every ``.npy`` file.
NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class Transformer:
    """Layout, channel swap, raw scale, mean and input scale, in Caffe's order."""

    hwc: bool
    channel_swap: tuple[int, ...]
    raw_scale: float
    mean: np.ndarray | None  # broadcastable to C x H x W
    input_scale: float

    @classmethod
    def for_model(cls, spec: ModelSpec) -> Transformer:
        """The transformer a model's ``[preprocess]`` asks for; reads its mean file."""
        settings = spec.preprocess
        channels = spec.input_shape[0]
        if settings.channel_swap and sorted(settings.channel_swap) != list(range(channels)):
            raise ModelError(
                f"model {spec.name!r}: channel_swap {settings.channel_swap} is not "
                f"a permutation of its {channels} channels"
            )
        mean = None
        if settings.mean:
            if len(settings.mean) not in (1, channels):
                raise ModelError(f"model {spec.name!r}: mean needs 1 or {channels} values")
            mean = np.asarray(settings.mean, np.float32).reshape(-1, 1, 1)
        elif settings.mean_file:
            mean = _mean_file(spec, settings.mean_file)
        return cls(
            settings.layout == "HWC",
            settings.channel_swap,
            settings.raw_scale,
            mean,
            settings.input_scale,
        )

    def __call__(self, images: np.ndarray) -> np.ndarray:
        """A float32, C-contiguous N x C x H x W batch (always a new array)."""
        batch = images.transpose(0, 3, 1, 2) if self.hwc else images
        if self.channel_swap:
            batch = batch[:, self.channel_swap]
        batch = np.array(batch, dtype=np.float32, order="C")
        if self.raw_scale != 1.0:
            batch *= self.raw_scale
        if self.mean is not None:
            batch -= self.mean
        if self.input_scale != 1.0:
            batch *= self.input_scale
        return batch


def _mean_file(spec: ModelSpec, path: Path) -> np.ndarray:
    """The mean a model's ``mean_file`` holds (a Caffe binaryproto or a ``.npy``), fitted to
    its input: a per-channel mean as it is, a larger mean image centre-cropped as Caffe's
    data layer crops it at test time (ImageNet's 256 x 256 mean on a 227 x 227 net).  Each
    of ``oversample``'s crops subtracts this same centre; Caffe's data layer would take the
    mean at the crop's own offsets (a small difference)."""
    try:
        mean = read_mean(path)
    except (CaffeFormatError, ValueError, OSError) as exc:
        raise ModelError(f"model {spec.name!r}: {exc}") from None
    channels, height, width = spec.input_shape
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim == 1 or (mean.ndim == 3 and mean.shape[1:] == (1, 1)):
        if mean.size != channels:
            raise ModelError(
                f"model {spec.name!r}: mean file {path} has {mean.size} channel "
                f"means, the input has {channels} channels"
            )
        return mean.reshape(-1, 1, 1)
    if (
        mean.ndim != 3
        or mean.shape[0] != channels
        or mean.shape[1] < height
        or mean.shape[2] < width
    ):
        raise ModelError(
            f"model {spec.name!r}: mean file {path} has shape {mean.shape}; the "
            f"input {spec.input_shape} needs {channels} x H x W with H >= {height} "
            f"and W >= {width} (a larger mean is centre-cropped), or {channels} "
            f"channel means"
        )
    top, left = (mean.shape[1] - height) // 2, (mean.shape[2] - width) // 2
    return np.ascontiguousarray(mean[:, top : top + height, left : left + width])


def read_mean(path: Path) -> np.ndarray:
    """A mean as float32: ``.npy`` by its magic bytes (never pickled), else a binaryproto."""
    with open(path, "rb") as handle:
        magic = handle.read(len(NPY_MAGIC))
    if magic == NPY_MAGIC:
        try:
            mean = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"cannot read mean file {path}: {exc}") from None
        if not np.issubdtype(mean.dtype, np.number):
            raise ValueError(f"mean file {path} must hold numbers, not {mean.dtype}")
        return mean.astype(np.float32)
    return read_blobproto(path)
