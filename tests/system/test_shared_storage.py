"""Inputs on shared storage: the workers read the images, the broker carries where they lie.

A real farm on loopback (its workers share this machine's file system, as a cluster's
nodes share NFS or Lustre): `.npy` rows and image files read by the workers, the broker's
bytes per image from its own count, a path map, and workers that cannot read the paths
(sent the bytes instead, the job exact all the same).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest

from farm.client.client import Client
from farm.client.inputs import open_input
from farm.ops.local import LocalFarm, farm_command
from tests.conftest import reference_forward

#: The most bytes per image the broker may carry for a shared job (issue 31's goal).
MAX_BYTES_PER_IMAGE = 200


def traffic(farm: LocalFarm) -> dict:
    with farm.client() as client:
        info = client.info()
    return {**info["traffic"], "stats": info["stats"]}


def run_counted(farm: LocalFarm, *args, **kwargs):
    """``Client.run`` on the farm, and the broker's input bytes and stats it added."""
    before = traffic(farm)
    with Client(farm.endpoint) as client:
        result = client.run(*args, **kwargs)
    after = traffic(farm)
    grown = {
        name: after["stats"][name] - before["stats"][name]
        for name in ("unshared_workers", "late_replies")
    }
    return result, after["input_bytes"] - before["input_bytes"], grown


def run_mapped(farm: LocalFarm, inputs, client_prefix: Path, worker_prefix: Path | str):
    """A shared LeNet job whose workers see ``client_prefix`` at ``worker_prefix``."""
    return run_counted(
        farm, inputs, "lenet", shared=True, path_map=[(str(client_prefix), str(worker_prefix))]
    )


@pytest.fixture(scope="module")
def digits_npy(tmp_path_factory, digits) -> Path:
    path = tmp_path_factory.mktemp("npy") / "digits.npy"
    np.save(path, digits)
    return path


def write_digits(folder: Path, digits: np.ndarray, suffix: str = ".png") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{index:04d}{suffix}" for index in range(len(digits))]
    for path, digit in zip(paths, digits):
        cv2.imwrite(str(path), digit)
    return paths


def test_a_shared_npy_is_read_by_the_workers_and_answers_exactly(
    farm_two_workers, digits_npy, lenet, digits
) -> None:
    sent, sent_bytes, _ = run_counted(farm_two_workers, open_input([str(digits_npy)]), "lenet")
    shared, shared_bytes, grown = run_counted(
        farm_two_workers, open_input([str(digits_npy)]), "lenet", shared=True
    )
    assert shared.shared and not sent.shared and not shared.failed
    np.testing.assert_array_equal(shared.outputs, sent.outputs)
    np.testing.assert_allclose(shared.outputs, reference_forward(lenet, digits), atol=1e-5)
    assert grown["unshared_workers"] == 0
    # sent: each image crosses the broker twice (in DATA, out in TASK)
    assert sent_bytes > 2 * digits[0].nbytes * len(digits)
    assert shared_bytes / len(digits) < MAX_BYTES_PER_IMAGE


def test_a_repeated_shared_npy_wraps_round_its_rows(farm_two_workers, digits_npy) -> None:
    from farm.client.inputs import repeated

    once = np.load(digits_npy)
    with Client(farm_two_workers.endpoint) as client:
        single = client.run(open_input([str(digits_npy)]), "lenet").outputs
        twice = client.run(repeated(open_input([str(digits_npy)]), 3), "lenet", shared=True)
    assert len(twice.outputs) == 3 * len(once)
    np.testing.assert_array_equal(twice.outputs, np.tile(single, (3, 1)))


def test_a_shared_folder_is_read_by_the_workers(farm_two_workers, tmp_path, lenet, digits) -> None:
    write_digits(tmp_path / "digits", digits[:300])
    sent, sent_bytes, _ = run_counted(farm_two_workers, [tmp_path / "digits"], "lenet")
    shared, shared_bytes, grown = run_counted(
        farm_two_workers, [tmp_path / "digits"], "lenet", shared=True
    )
    assert not shared.failed and grown["unshared_workers"] == 0
    np.testing.assert_array_equal(shared.outputs, sent.outputs)
    np.testing.assert_allclose(shared.outputs, reference_forward(lenet, digits[:300]), atol=1e-5)
    assert sent_bytes / 300 > 2 * 100  # a 28 x 28 PNG digit is a few hundred bytes
    assert shared_bytes / 300 < MAX_BYTES_PER_IMAGE


def test_a_path_map_points_the_workers_at_their_own_mount(
    farm_two_workers, tmp_path, lenet, digits
) -> None:
    """The client's folder and the workers' mount hold different digits under the same names
    (BMP: the same sizes): the answers are the mount's, so the workers read the mapped
    paths."""
    client_side = write_digits(tmp_path / "client", digits[:100], ".bmp")
    write_digits(tmp_path / "mount", digits[100:200], ".bmp")
    result, _, grown = run_mapped(
        farm_two_workers, client_side, tmp_path / "client", tmp_path / "mount"
    )
    assert not result.failed and grown["unshared_workers"] == 0
    np.testing.assert_allclose(result.outputs, reference_forward(lenet, digits[100:200]), atol=1e-5)


def test_workers_that_cannot_read_the_paths_are_sent_the_bytes(
    farm_two_workers, tmp_path, lenet, digits, digits_npy
) -> None:
    """A map to a folder no worker has: each worker fails its first chunk uncharged, says
    why, and the broker sends it the bytes from then on; every answer is exact."""
    paths = write_digits(tmp_path / "digits", digits[:300])
    result, sent_bytes, grown = run_mapped(farm_two_workers, paths, tmp_path, "/nonexistent-mount")
    assert not result.failed and grown["unshared_workers"] == 2
    np.testing.assert_allclose(result.outputs, reference_forward(lenet, digits[:300]), atol=1e-5)
    assert result.summary.failed_attempts == 0, "a worker's blindness is not the images' fault"
    result, _, grown = run_mapped(
        farm_two_workers, open_input([str(digits_npy)]), digits_npy.parent, "/nonexistent-mount"
    )
    assert not result.failed and grown["unshared_workers"] == 2


def test_a_file_missing_on_the_mount_fails_alone_with_the_worker_s_reason(
    farm_two_workers, tmp_path, lenet, digits
) -> None:
    client_side = write_digits(tmp_path / "client", digits[:50], ".bmp")
    mounted = write_digits(tmp_path / "mount", digits[:50], ".bmp")
    mounted[7].unlink()
    result, _, grown = run_mapped(
        farm_two_workers, client_side, tmp_path / "client", tmp_path / "mount"
    )
    assert grown["unshared_workers"] == 0, "the other files of its chunk were read"
    assert [(f.start, f.count) for f in result.failed] == [(7, 1)]
    assert "cannot read" in result.failed[0].error and "0007.bmp" in result.failed[0].error
    expected = reference_forward(lenet, digits[:50])
    keep = np.arange(50) != 7
    np.testing.assert_allclose(result.outputs[keep], expected[keep], atol=1e-5)
    assert np.isnan(result.outputs[7]).all()


def test_a_changed_npy_is_not_read_as_the_client_s(
    farm_two_workers, tmp_path, lenet, digits
) -> None:
    """The mount's .npy differs from the client's within its first bytes: the workers refuse
    it and are sent the client's rows."""
    np.save(tmp_path / "client.npy", digits[:200])
    (tmp_path / "mount").mkdir()
    np.save(tmp_path / "mount" / "client.npy", digits[200:400])
    result, _, grown = run_mapped(
        farm_two_workers, open_input([str(tmp_path / "client.npy")]), tmp_path, tmp_path / "mount"
    )
    assert not result.failed and grown["unshared_workers"] == 2
    np.testing.assert_allclose(result.outputs, reference_forward(lenet, digits[:200]), atol=1e-5)


def test_inputs_that_cannot_be_shared_are_sent_with_a_notice(
    farm_two_workers, tmp_path, digits
) -> None:
    np.save(tmp_path / "wide.npy", digits[:100].astype(np.float64))
    notices: list[str] = []
    with Client(farm_two_workers.endpoint) as client:
        result = client.run(
            open_input([str(tmp_path / "wide.npy")]), "lenet", shared=True, notice=notices.append
        )
        in_memory = client.run(digits[:10], "lenet", shared=True, notice=notices.append)
    assert not result.shared and not result.failed and not in_memory.shared
    assert "float64" in notices[0] and "sent" in notices[0]
    assert "in memory" in notices[1]


def test_farm_submit_shared_and_a_bad_path_map(farm_two_workers, digits_npy, tmp_path) -> None:
    out = tmp_path / "out.npy"
    command = farm_command(
        "submit", str(digits_npy), "--broker", farm_two_workers.endpoint, "--quiet", "--shared"
    )
    done = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert np.load(out).shape == (1000, 10)
    bad = subprocess.run(
        [*command, "--path-map", "relative=/mnt"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "CLIENT_PREFIX=WORKER_PREFIX" in bad.stderr
