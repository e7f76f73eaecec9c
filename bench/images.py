"""Image files against `.npy` input: one two-worker farm, the same images both ways.

``--images`` (10 000) JPEG files of 227 x 227 (quality 90) are cut from scikit-image's
photos (random crops, flips and colour shifts, seeded), and the same images, decoded,
are saved as one uint8 `.npy` (N x 227 x 227 x 3, RGB).  A broker and two pinned
workers (``farm.ops.local.LocalFarm``) run SqueezeNet v1.0 (the real ImageNet net in
``../shared``; ``--model`` names another of the repository) on both inputs, in turn,
``--rounds`` times, so both see the same machine.  Printed per input: images/s, the
bytes the client sent (DATA payloads), and their ratio.  The float32 row is what a
client sending preprocessed float32 pixels would send (4x the uint8 bytes: computed,
not run).  Then the decode time per image, in-process on one thread (the worker's
cost), and its share of a worker's time per image in the files run.

    python bench/images.py [--images 10000] [--rounds 1] [--save FILE]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from farm.benchsuite.common import machine, saved, shared_squeezenet
from farm.client.client import Client
from farm.client.inputs import find_image_files
from farm.client.npy import NpyReader
from farm.engines.images import ImageDecoder
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, cores

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "squeezenet_v1.0"
SIZE = 227


def make_images(folder: Path, count: int) -> np.ndarray:
    """``count`` JPEGs of SIZE x SIZE in ``folder``; returns them decoded (RGB, uint8)."""
    import skimage.data

    photos = [
        skimage.data.chelsea(),
        skimage.data.coffee(),
        skimage.data.astronaut(),
        skimage.data.rocket(),
        skimage.data.immunohistochemistry(),
    ]
    rng = np.random.default_rng(0)
    decoded = np.empty((count, SIZE, SIZE, 3), np.uint8)
    for index in range(count):
        photo = photos[index % len(photos)]
        top = rng.integers(0, photo.shape[0] - SIZE + 1)
        left = rng.integers(0, photo.shape[1] - SIZE + 1)
        crop = photo[top : top + SIZE, left : left + SIZE]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crop = np.clip(crop * rng.uniform(0.8, 1.2, 3), 0, 255).astype(np.uint8)
        path = folder / f"{index // 1000:02d}" / f"{index:06d}.jpg"
        path.parent.mkdir(exist_ok=True)
        cv2.imwrite(str(path), crop[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])
        decoded[index] = cv2.imread(str(path))[..., ::-1]  # what the workers will see
    return decoded


def timed_job(endpoint: str, images: object, model: str) -> tuple[float, int]:
    """Images/s of one job, and the bytes the client sent."""
    with Client(endpoint, timeout=600) as client:
        started = time.perf_counter()
        result = client.run(images, model)  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
    assert not result.failed, result.failed[:3]
    return len(result.outputs) / seconds, result.input_bytes


def decode_time(files: list[Path], model: str, models: Path) -> float:
    """Microseconds per file of ``ImageDecoder.decode``, one thread, best of 3 passes."""
    cv2.setNumThreads(1)
    decoder = ImageDecoder(find(model, [str(models)]))
    blobs = [path.read_bytes() for path in files]
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        decoder.decode(blobs)
        best = min(best, time.perf_counter() - started)
    return best / len(blobs) * 1e6


def main(arguments: argparse.Namespace) -> int:
    print(machine())
    work = Path(tempfile.mkdtemp(prefix="farm-images-"))
    try:
        models = work / "models"
        if arguments.model == "squeezenet_v1.0":
            shared_squeezenet(models, SHARED)
        else:
            models = None
        folder = work / "photos"
        folder.mkdir()
        decoded = make_images(folder, arguments.images)
        array_path = work / "images.npy"
        np.save(array_path, decoded)
        files = find_image_files([str(folder)])
        jpeg_bytes = sum(path.stat().st_size for path in files)
        print(
            f"{len(files):,} JPEG files of {SIZE}x{SIZE} (quality 90), "
            f"{jpeg_bytes / len(files) / 1024:.1f} KiB each on average; model "
            f"{arguments.model}; 2 pinned workers"
        )
        extra = ["--models-dir", str(models)] if models else []
        devices = [f"cpu:{core}" for core in cores()[:2]]
        rates: dict[str, list[float]] = {"files": [], "npy": []}
        sent: dict[str, int] = {}
        with LocalFarm(
            devices=devices, preload=[arguments.model], broker_options=extra, worker_options=extra
        ) as local:
            timed_job(local.endpoint, [str(path) for path in files[:50]], arguments.model)
            for _ in range(arguments.rounds):
                for kind, images in (("files", [str(folder)]), ("npy", NpyReader.open(array_path))):
                    rate, sent[kind] = timed_job(local.endpoint, images, arguments.model)
                    rates[kind].append(rate)
        files_rate, npy_rate = (statistics.median(rates[k]) for k in ("files", "npy"))
        float_bytes = decoded.size * 4
        print(f"\n{'input':<28} {'images/s':>9} {'sent by the client':>20} {'bytes/image':>12}")
        print(
            f"{'JPEG files':<28} {files_rate:>9.1f} {sent['files']:>20,} "
            f"{sent['files'] / len(files):>12,.0f}"
        )
        print(
            f"{'.npy uint8 (decoded)':<28} {npy_rate:>9.1f} {sent['npy']:>20,} "
            f"{sent['npy'] / len(files):>12,.0f}"
        )
        print(
            f"{'float32 pixels (computed)':<28} {'':>9} {float_bytes:>20,} "
            f"{float_bytes / len(files):>12,.0f}"
        )
        print(
            f"\nimages/s, files / npy: {files_rate / npy_rate:.3f} "
            f"(rounds: files {', '.join(f'{r:.1f}' for r in rates['files'])}; "
            f"npy {', '.join(f'{r:.1f}' for r in rates['npy'])})"
        )
        print(
            f"bytes sent: uint8 / files {sent['npy'] / sent['files']:.1f}x, "
            f"float32 / files {float_bytes / sent['files']:.1f}x"
        )
        micro = decode_time(files[:500], arguments.model, models or work)
        per_image = 2 / files_rate * 1e6  # two workers: each spends this per image
        print(
            f"decode: {micro:.0f} us per file on one thread, {micro / per_image:.1%} of a "
            f"worker's {per_image / 1000:.1f} ms per image in the files run"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", default="squeezenet_v1.0")
    parser.add_argument(
        "--save", type=Path, default=Path("-"), help="Also write the printout here."
    )
    args = parser.parse_args()
    if args.model == "squeezenet_v1.0" and not SHARED.is_dir():
        sys.exit(f"the real SqueezeNet is not at {SHARED}")
    sys.exit(saved(args.save, lambda: main(args)))
