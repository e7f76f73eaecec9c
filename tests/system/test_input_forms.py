"""Inputs in the forms users give them, through one real farm: an N x H x W array for a
1-channel model added with ``farm models add`` (which records the HWC layout), integer
arrays wider than uint8, photos with an EXIF orientation, a list of arrays, and a
``--top-k`` beyond the model's classes."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from farm.client.client import Client, FarmError
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, farm_command
from tests.conftest import reference_forward

#: Outputs of one image on two workers, which may run different engines.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def repository(tmp_path_factory, lenet) -> Path:
    """A model repository holding "gray": LeNet's files added with ``farm models add``."""
    folder = tmp_path_factory.mktemp("models")
    done = subprocess.run(
        farm_command(
            "models",
            "add",
            "gray",
            "--prototxt",
            str(lenet.prototxt),
            "--weights",
            str(lenet.weights),
            "--scale",
            "0.00390625",
            "--count",
            "2",
        ),
        env={**os.environ, "FARM_MODELS": str(folder)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert find("gray", [folder]).item_shape == (28, 28, 1)  # HWC, as added models are
    return folder


@pytest.fixture(scope="module")
def farm(module_local_farm, repository) -> LocalFarm:
    """Two workers; the broker serves "gray" (the workers fetch it) and the bundled models."""
    return module_local_farm(2, chunk=100, models_dir=repository, preload=["lenet"])


def submit(farm: LocalFarm, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        farm_command("submit", *arguments, "--broker", farm.endpoint, "--quiet"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_n_h_w_array_runs_on_an_added_grey_model(farm, lenet, digits, tmp_path) -> None:
    images, out = tmp_path / "digits.npy", tmp_path / "scores.npy"
    np.save(images, digits[:200])  # N x H x W
    done = submit(farm, str(images), "--model", "gray", "--out", str(out))
    assert done.returncode == 0, done.stderr
    expected = reference_forward(lenet, digits[:200])
    np.testing.assert_allclose(np.load(out), expected, atol=1e-5)
    with Client(farm.endpoint) as client:  # N x 1 x H x W and N x H x W x 1 alike
        for given in (digits[:200, None], digits[:200, ..., None]):
            np.testing.assert_allclose(client.map(given, "gray"), expected, atol=1e-5)


def test_an_hwc_array_for_a_chw_model_is_told_the_transpose(farm, tmp_path) -> None:
    images = tmp_path / "hwc.npy"
    np.save(images, np.zeros((4, 28, 28, 1), np.uint8).repeat(3, axis=3))
    done = submit(farm, str(images), "--model", "lenet")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "Error: images of shape (28, 28, 3) do not match model 'lenet', which takes "
        "(1, 28, 28) (C x H x W)"
    )
    np.save(images, np.zeros((4, 32, 32, 3), np.uint8))
    with Client(farm.endpoint) as client, pytest.raises(FarmError) as caught:
        client.map(np.load(images).transpose(0, 3, 1, 2), "cifar10_quick")
    assert str(caught.value).endswith(
        "which takes (32, 32, 3) (H x W x C); these look C x H x W: pass "
        "images.transpose(0, 2, 3, 1) (N x C x H x W -> N x H x W x C)"
    )


def test_wide_integer_arrays_are_pixels_or_refused(farm, lenet, digits, tmp_path) -> None:
    scaled, fits, out = tmp_path / "x257.npy", tmp_path / "fits.npy", tmp_path / "scores.npy"
    np.save(scaled, digits[:100].astype(np.uint16) * 257)
    done = submit(farm, str(scaled), "--model", "lenet", "--out", str(out))
    assert done.returncode == 1 and not out.exists()
    assert done.stderr.splitlines()[-1] == (
        f"Error: {scaled} is uint16 with values up to 65,535; integer images are pixels and "
        f"the model takes 0..255: for 16-bit pixels divide by 257 "
        f"(np.round(images / 257).astype(np.uint8)), or, if the model takes these values "
        f"as they are, save them as float32 (images.astype(np.float32)); nothing was "
        f"submitted"
    )
    np.save(fits, digits[:100].astype(np.int32))
    done = submit(farm, str(fits), "--model", "lenet", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"{fits}: int32 values all within 0..255: sent as uint8 pixels, unchanged" in (
        done.stderr.splitlines()
    )
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits[:100]), atol=1e-5)


def photos(folder: Path) -> tuple[Path, Path, Path]:
    """A JPEG stored 32 x 48 with EXIF orientation 6 (turn 90 degrees clockwise to show
    it), and its pixels as PNG files: upright (as a viewer shows it) and as stored."""
    y, x = np.mgrid[0:32, 0:48]
    rgb = np.stack([255 * x / 47, 255 * y / 31, 128 + 100 * np.sin((x + 2 * y) / 5)], axis=-1)
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = folder / "phone.jpg"
    Image.fromarray(rgb.astype(np.uint8)).save(rotated, quality=95, exif=exif.tobytes())
    stored = cv2.imread(str(rotated), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    cv2.imwrite(str(folder / "stored.png"), stored)
    cv2.imwrite(str(folder / "upright.png"), cv2.rotate(stored, cv2.ROTATE_90_CLOCKWISE))
    return rotated, folder / "upright.png", folder / "stored.png"


def test_a_photo_is_turned_upright_by_its_exif_orientation_unless_told(farm, tmp_path) -> None:
    files = photos(tmp_path)
    outputs = {}
    for option in ((), ("--no-exif-rotate",)):
        out = tmp_path / f"scores{len(option)}.npy"
        done = submit(
            farm, *map(str, files), "--model", "cifar10_quick", "--out", str(out), *option
        )
        assert done.returncode == 0, done.stderr
        outputs[option] = np.load(out)
        summary = done.stdout.splitlines()
        if option:
            assert "1 image with an EXIF orientation ran as stored (--no-exif-rotate)" in summary
        else:
            assert (
                "1 image turned upright by EXIF orientation, as photo viewers do "
                "(--no-exif-rotate: the stored pixels)"
            ) in summary
    turned, as_stored = outputs[()], outputs[("--no-exif-rotate",)]
    assert not np.allclose(turned[1], turned[2], atol=100 * TOLERANCE)  # the test means it
    np.testing.assert_allclose(turned[0], turned[1], atol=TOLERANCE)  # as the upright one
    np.testing.assert_allclose(as_stored[0], as_stored[2], atol=TOLERANCE)  # as stored
    with Client(farm.endpoint) as client:  # the Python client's option
        result = client.run([files[0]], "cifar10_quick", exif_rotate=False)
    assert result.oriented == 1 and not result.exif_rotate
    np.testing.assert_allclose(result.outputs[0], as_stored[2], atol=TOLERANCE)


def test_a_list_of_arrays_runs_as_one_stacked_array(farm, lenet, digits) -> None:
    with Client(farm.endpoint) as client:
        outputs = client.map([digits[0], digits[1], digits[2]], "lenet")
        np.testing.assert_allclose(outputs, reference_forward(lenet, digits[:3]), atol=1e-5)
        with pytest.raises(FarmError, match=r"images\[1\] is uint8 \(28, 27\), images\[0\]"):
            client.run([digits[0], digits[1][:, 1:]], "lenet")


def test_top_k_beyond_the_classes_lists_them_all_once(farm, digits, tmp_path) -> None:
    images, out = tmp_path / "digits.npy", tmp_path / "answers.csv"
    np.save(images, digits[:20])
    done = submit(farm, str(images), "--model", "lenet", "--top-k", "5000", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "--top-k 5000: the model has 10 classes; each answer lists them all" in (
        done.stderr.splitlines()
    )
    with open(out, newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0][-4:] == ["id_10", "name_10", "probability_10", "error"]
    assert len(rows) == 21 and all(len(row) == 32 for row in rows)
