"""Public Caffe nets added the way a user adds a download, then run on image files.

For each net of ``bench/nets`` (prototxts from their original repositories: ResNet-50,
GoogLeNet, MobileNet v2, DenseNet-121), the seeded weights stand in for the download:
``farm models add`` copies prototxt and weights into a fresh repository, writes the
model.toml and checks the net on every backend; then ``farm run`` on two photos (JPEG
files) must equal a direct OpenCV forward of the same files, decoded and preprocessed as
docs/inputs.md says.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from farm.modelrepo.repository import find, prepare
from farm.ops.local import farm_command

NETS = Path(__file__).resolve().parents[2] / "bench" / "nets"
MEAN = np.array([104.0, 117.0, 123.0], np.float32)


def public_nets() -> list[str]:
    return sorted(folder.name for folder in NETS.iterdir() if (folder / "model.toml").is_file())


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    import skimage.data

    folder = tmp_path_factory.mktemp("photos")
    Image.fromarray(skimage.data.chelsea()).save(folder / "cat.jpg", quality=90)
    Image.fromarray(skimage.data.coffee()).save(folder / "coffee.jpg", quality=90)
    return folder


def direct_forward(
    prototxt: Path, weights: Path, output: str, photo: Path, size: int
) -> np.ndarray:
    """Shorter side to 256, centre crop, BGR minus the means, OpenCV's own importer."""
    image = cv2.imread(str(photo), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    height, width = image.shape[:2]
    scale = 256 / min(height, width)
    image = cv2.resize(
        image, (int(width * scale + 0.5), int(height * scale + 0.5)), interpolation=cv2.INTER_LINEAR
    )
    top, left = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
    crop = image[top : top + size, left : left + size].astype(np.float32) - MEAN
    net = cv2.dnn.readNetFromCaffe(str(prototxt), str(weights))
    net.setInput(np.ascontiguousarray(crop.transpose(2, 0, 1)[None]))
    return net.forward(output).reshape(-1)


@pytest.mark.parametrize("net", public_nets())
def test_a_downloaded_net_is_added_in_one_command_and_runs_on_photos(net, photos, tmp_path) -> None:
    bench_spec = find(net, [str(NETS)])
    weights = prepare(bench_spec)  # the seeded stand-in for the downloaded .caffemodel
    repository = tmp_path / "models"
    added = subprocess.run(
        farm_command(
            "models",
            "add",
            f"my-{net}",
            "--prototxt",
            str(bench_spec.prototxt),
            "--weights",
            str(weights),
            "--mean",
            "104,117,123",
            "--resize",
            "256",
            "--models-dir",
            str(repository),
            "--count",
            "1",
        ),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert added.returncode == 0, added.stdout + added.stderr
    spec = find(f"my-{net}", [str(repository)])
    assert spec.prototxt.read_bytes() == bench_spec.prototxt.read_bytes()

    out = tmp_path / "scores.npy"
    run = subprocess.run(
        farm_command(
            "run",
            str(photos),
            "--model",
            f"my-{net}",
            "--models-dir",
            str(repository),
            "--out",
            str(out),
            "--workers",
            "1",
            "--backend",
            "opencv",
            "--quiet",
        ),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    scores = np.load(out).reshape(2, -1)
    size = spec.input_shape[1]
    for row, name in enumerate(("cat.jpg", "coffee.jpg")):
        expected = direct_forward(spec.prototxt, spec.weights, spec.output, photos / name, size)
        np.testing.assert_allclose(
            scores[row], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
        )
