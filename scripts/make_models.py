"""Write the bundled CIFAR-10 quick files: seeded weights, a mean file and sample images.

No CIFAR-10 images are available offline, so the weights come from Caffe's
``xavier`` filler (seeded) and the sample is 64 synthetic 32x32 RGB pictures
(coloured discs and bars on graded backgrounds).  The mean file is the mean of
those pictures in the net's RGB, C x H x W order, as Caffe's
``compute_image_mean`` writes it from the CIFAR-10 LMDB (whose records keep the
binary files' R, G, B planes: examples/cifar10/convert_cifar_data.cpp).  (LeNet is trained:
scripts/train_lenet.py.
CaffeNet's weights are made on first use: ``farm models prepare caffenet``.)

    python scripts/make_models.py
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from farm.modelrepo.caffe_net import Network, generated_weights
from farm.modelrepo.caffe_proto import write_blobproto, write_caffemodel

FOLDER = Path(__file__).resolve().parent.parent / "farm" / "models" / "cifar10_quick"


def synthetic_pictures(count: int, rng: np.random.Generator) -> np.ndarray:
    """N x 32 x 32 x 3 RGB uint8: a graded background with a disc and a bar."""
    pictures = np.empty((count, 32, 32, 3), np.uint8)
    ramp = np.linspace(0, 1, 32, dtype=np.float32)[None, :, None]
    for picture in pictures:
        low, high = rng.integers(0, 256, (2, 3))
        picture[:] = (low + (high - low) * ramp).astype(np.uint8)
        centre = tuple(int(v) for v in rng.integers(6, 26, 2))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        cv2.circle(picture, centre, int(rng.integers(3, 10)), colour, -1)
        start = tuple(int(v) for v in rng.integers(0, 32, 2))
        end = tuple(int(v) for v in rng.integers(0, 32, 2))
        cv2.line(
            picture,
            start,
            end,
            tuple(int(v) for v in rng.integers(0, 256, 3)),
            int(rng.integers(1, 4)),
        )
    return pictures


def main() -> None:
    rng = np.random.default_rng(10)
    net = Network.load(FOLDER / "deploy.prototxt")
    write_caffemodel(FOLDER / "cifar10_quick.caffemodel", net.name, generated_weights(net, 10))
    pictures = synthetic_pictures(64, rng)
    np.save(FOLDER / "images.npy", pictures)
    rgb_chw = pictures.transpose(0, 3, 1, 2).astype(np.float32)
    write_blobproto(FOLDER / "mean.binaryproto", rgb_chw.mean(axis=0, keepdims=True))
    print(f"wrote {FOLDER}")


if __name__ == "__main__":
    main()
