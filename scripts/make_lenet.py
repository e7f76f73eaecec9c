"""Write the bundled LeNet weights and sample images (deterministic, no download).

Weights: Caffe's ``xavier`` filler (uniform in +-sqrt(3 / fan_in)), seeded, as
Caffe initialises LeNet.  Sample: digits 0-9 drawn with OpenCV's fonts at
random scales, offsets and thickness, 28x28 uint8 (N x H x W).

    python scripts/make_lenet.py
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from farm.caffe_proto import write_caffemodel

FOLDER = Path(__file__).resolve().parent.parent / "farm" / "models" / "lenet"
SHAPES = {"conv1": (20, 1, 5, 5), "conv2": (50, 20, 5, 5), "ip1": (500, 800), "ip2": (10, 500)}
TYPES = {"conv1": "Convolution", "conv2": "Convolution", "ip1": "InnerProduct",
         "ip2": "InnerProduct"}
FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX,
         cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_PLAIN)


def xavier(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    fan_in = int(np.prod(shape[1:]))
    scale = np.sqrt(3.0 / fan_in)
    return rng.uniform(-scale, scale, size=shape).astype(np.float32)


def make_weights(seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    layers = [(name, TYPES[name], [xavier(rng, shape),
                                   rng.uniform(-0.05, 0.05, shape[0]).astype(np.float32)])
              for name, shape in SHAPES.items()]
    write_caffemodel(str(FOLDER / "lenet.caffemodel"), "LeNet", layers)


def draw_digit(rng: np.random.Generator, digit: int) -> np.ndarray:
    canvas = np.zeros((28, 28), dtype=np.uint8)
    font = FONTS[rng.integers(len(FONTS))]
    scale = rng.uniform(0.7, 1.0) * (2.0 if font == cv2.FONT_HERSHEY_PLAIN else 1.0)
    origin = (int(rng.integers(3, 10)), int(rng.integers(20, 26)))
    cv2.putText(canvas, str(digit), origin, font, scale, 255, int(rng.integers(1, 3)),
                cv2.LINE_AA)
    return canvas


def make_sample(count: int = 1000, seed: int = 2) -> None:
    rng = np.random.default_rng(seed)
    images = np.stack([draw_digit(rng, i % 10) for i in range(count)])
    np.save(FOLDER / "images.npy", images)


if __name__ == "__main__":
    make_weights()
    make_sample()
    print(f"wrote {FOLDER / 'lenet.caffemodel'} and {FOLDER / 'images.npy'}")
