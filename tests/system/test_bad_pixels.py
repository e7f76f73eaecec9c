"""float32 images with a NaN or infinite pixel fail alone, with the reason; the rest of their
chunk, and of their job, comes back exact."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from farm.client.client import FailedItems, FarmError
from farm.ops.local import farm_command
from farm.workers.worker import NON_FINITE, finite_items
from tests.conftest import reference_forward

#: Items spoiled (by one pixel each) in a job of 357 run in fifo chunks of 100: three side by
#: side and one apart in the first chunk, one in the second, two at the end of the last.
SPOILED = {3: np.nan, 4: np.inf, 5: -np.inf, 7: np.nan, 150: -np.inf, 355: np.inf, 356: np.nan}


def spoiled_digits(digits: np.ndarray, spoiled: dict[int, float], count: int) -> np.ndarray:
    """The first ``count`` digits as float32, with one pixel of each ``spoiled`` item set."""
    images = digits[:count].astype(np.float32)
    for index, value in spoiled.items():
        images[index, index % 28, (index * 7) % 28] = value
    return images


def failed_indexes(failed: list[FailedItems]) -> list[int]:
    """Every item index the failed runs cover, in order (once each)."""
    indexes = [index for f in failed for index in range(f.start, f.start + f.count)]
    assert len(set(indexes)) == len(indexes), failed
    return sorted(indexes)


def assert_good_rows_exact(lenet, images: np.ndarray, outputs: np.ndarray, bad: list[int]) -> None:
    """The bad rows are NaN; every other row is the reference forward's."""
    good = np.setdiff1d(np.arange(len(images)), bad)
    assert np.isnan(outputs[bad]).all()
    np.testing.assert_allclose(outputs[good], reference_forward(lenet, images[good]), atol=1e-5)


def test_nan_and_infinite_items_fail_alone_in_and_across_chunks(
    farm_two_workers, lenet, digits
) -> None:
    images = spoiled_digits(digits, SPOILED, 357)
    with farm_two_workers.client() as client:
        result = client.run(images, "lenet")
    assert failed_indexes(result.failed) == sorted(SPOILED)
    assert {f.error for f in result.failed} == {NON_FINITE}
    assert result.summary.items == 357  # every chunk ran: none failed as a whole
    assert_good_rows_exact(lenet, images, result.outputs, sorted(SPOILED))


def test_a_chunk_whose_every_item_is_nan_fails_alone(farm_two_workers, lenet, digits) -> None:
    images = digits[:300].astype(np.float32)
    images[100:200] = np.nan  # the second chunk of 100, whole
    with farm_two_workers.client() as client:
        result = client.run(images, "lenet")
    assert failed_indexes(result.failed) == list(range(100, 200))
    assert {f.error for f in result.failed} == {NON_FINITE}
    assert_good_rows_exact(lenet, images, result.outputs, list(range(100, 200)))


def test_a_job_of_nan_items_only_raises_with_the_reason(farm_two_workers, digits) -> None:
    images = np.full((250, 28, 28), np.nan, np.float32)
    with farm_two_workers.client() as client, pytest.raises(FarmError) as raised:
        client.map(images, model="lenet")
    assert str(raised.value).startswith("250 images failed:")
    assert NON_FINITE in str(raised.value)


def test_submit_names_the_failed_items_and_exits_1(
    farm_two_workers, lenet, digits, tmp_path
) -> None:
    images, out = tmp_path / "images.npy", tmp_path / "scores.npy"
    np.save(images, spoiled_digits(digits, SPOILED, 357))
    done = subprocess.run(
        farm_command(
            "submit",
            str(images),
            "--model",
            "lenet",
            "--broker",
            farm_two_workers.endpoint,
            "--out",
            str(out),
            "--quiet",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "7 images failed:" in done.stderr
    for run in ("items 3..5", "item 7", "item 150", "items 355..356"):
        assert f"{run}: {NON_FINITE}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert_good_rows_exact(lenet, np.load(images), np.load(out), sorted(SPOILED))


def test_only_float_items_with_a_non_finite_pixel_are_flagged() -> None:
    images = np.zeros((5, 2, 3), np.float32)
    images[1, 1, 2], images[3, 0, 0] = np.inf, np.nan
    images[4] = np.finfo(np.float32).max  # large, but finite
    assert finite_items(images).tolist() == [True, False, True, False, True]
    assert finite_items(np.full((3, 2, 2), 255, np.uint8)).all()
