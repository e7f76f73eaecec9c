"""Worker-side decode time per image file: 227 x 227 JPEGs (quality 90) for CaffeNet.

One thread, as a worker runs.  Rows: OpenCV's ``imdecode`` alone (the floor), then
``ImageDecoder.decode`` with squeezenet-like settings (shorter side 256, centre crop
227) and with no resize (the file is already the net's size, so the crop is the whole
image).  Each figure is the best of several passes over the same files, in
microseconds per image.

    python bench/decode.py [--images 200] [--passes 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import time
from collections.abc import Callable

import cv2
import numpy as np
from PIL import Image

from farm.engines.images import ImageDecoder, imread_flags
from farm.modelrepo.repository import Resize, find


def photos(count: int, size: int = 227) -> list[bytes]:
    """JPEGs (quality 90) of smooth colour fields with some texture, as photos compress."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    files = []
    for _ in range(count):
        a, b, c = rng.uniform(1, 12, 3)
        rgb = (
            np.stack(
                [np.sin(a * x + b * y), np.cos(b * x * y * 4 + c), np.sin(c * (x - y))], axis=-1
            )
            * 100
            + 128
            + rng.normal(0, 8, (size, size, 3))
        )
        buffer = io.BytesIO()
        Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
        files.append(buffer.getvalue())
    return files


def best_us(run: Callable[[], object], images: int, passes: int) -> float:
    """The fastest of ``passes`` runs, in microseconds per image."""
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) / images * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    cv2.setNumThreads(1)
    files = photos(args.images)
    spec = find("caffenet")  # 227 x 227 x 3 HWC; only the spec is needed, not the weights
    flags = imread_flags(3)
    rows = [
        (
            "cv2.imdecode alone",
            lambda: [cv2.imdecode(np.frombuffer(f, np.uint8), flags) for f in files],
        )
    ]
    for label, settings in (
        ("shorter side 256 + centre crop 227", Resize(shorter_side=256)),
        ("no resize (227 x 227 as it is)", Resize()),
    ):
        decoder = ImageDecoder(dataclasses.replace(spec, resize=settings))
        batch = decoder.decode(files)
        assert not batch.failures and batch.images.shape == (len(files), 227, 227, 3)
        rows.append((f"decode: {label}", lambda d=decoder: d.decode(files)))
    size = sum(map(len, files)) / len(files)
    print(
        f"{len(files)} JPEGs of 227 x 227, quality 90, {size / 1024:.1f} KiB on average; "
        f"1 thread, best of {args.passes} passes"
    )
    for label, run in rows:
        print(f"  {label:<45} {best_us(run, len(files), args.passes):8.0f} us/image")


if __name__ == "__main__":
    main()
