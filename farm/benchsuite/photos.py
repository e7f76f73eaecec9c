"""Real photos for the precision benches: scikit-image's sample photos (colour ones, and
grey ones as three equal channels), cut and resized variously, seeded.  Different seeds
give different crops: calibration and validation sets that share no image."""

from __future__ import annotations

import cv2
import numpy as np


def sources() -> list[np.ndarray]:
    """The sample photos scikit-image ships (no download), RGB uint8."""
    import skimage.data as data

    colour = [
        data.astronaut(),
        data.chelsea(),
        data.coffee(),
        data.rocket(),
        data.hubble_deep_field(),
        data.immunohistochemistry(),
        data.retina(),
        *data.stereo_motorcycle()[:2],
    ]
    grey = [data.camera(), data.coins(), data.moon(), data.grass(), data.gravel(),
            data.brick(), data.clock()]  # fmt: skip
    return colour + [np.repeat(image[:, :, np.newaxis], 3, axis=2) for image in grey]


def crops(count: int, seed: int, size: tuple[int, int]) -> np.ndarray:
    """``count`` RGB uint8 images of ``size`` (height, width): a random photo, a crop of 30
    to 100% of its shorter side at an aspect of 0.8-1.25, resized, mirrored half the time,
    its contrast and brightness shifted."""
    rng = np.random.default_rng(seed)
    photos = sources()
    out = np.empty((count, *size, 3), np.uint8)
    for index in range(count):
        photo = photos[rng.integers(len(photos))]
        height, width = photo.shape[:2]
        side = int(min(height, width) * rng.uniform(0.3, 1.0))
        crop_w = min(width, int(side * rng.uniform(0.8, 1.25)))
        top = int(rng.integers(0, height - side + 1))
        left = int(rng.integers(0, width - crop_w + 1))
        image = cv2.resize(
            photo[top : top + side, left : left + crop_w],
            (size[1], size[0]),
            interpolation=cv2.INTER_AREA,
        )
        if rng.random() < 0.5:
            image = image[:, ::-1]
        shifted = image.astype(np.float32) * rng.uniform(0.8, 1.2) + rng.uniform(-20, 20)
        out[index] = np.clip(shifted, 0, 255).astype(np.uint8)
    return out
