"""Caffe's ``Transformer``: images as clients send them -> the net's float32 N x C x H x W input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from farm.caffe_proto import CaffeFormatError, read_blobproto
from farm.repository import ModelError, ModelSpec


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
            raise ModelError(f"model {spec.name!r}: channel_swap {settings.channel_swap} is not "
                             f"a permutation of its {channels} channels")
        mean = None
        if settings.mean:
            if len(settings.mean) not in (1, channels):
                raise ModelError(f"model {spec.name!r}: mean needs 1 or {channels} values")
            mean = np.asarray(settings.mean, np.float32).reshape(-1, 1, 1)
        elif settings.mean_file:
            mean = _mean_file(spec, settings.mean_file)
        return cls(settings.layout == "HWC", settings.channel_swap, settings.raw_scale, mean,
                   settings.input_scale)

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
    """The mean image a model's ``mean_file`` holds, checked against its input shape."""
    try:
        mean = read_blobproto(path)
    except CaffeFormatError as exc:
        raise ModelError(f"model {spec.name!r}: {exc}") from None
    mean = mean.reshape(mean.shape[-3:]) if mean.ndim == 4 else mean
    if mean.shape != spec.input_shape:
        raise ModelError(f"model {spec.name!r}: mean file {path} has shape {mean.shape}, the "
                         f"input is {spec.input_shape}")
    return mean
