"""A killed client resumes from its journal; an output that cannot be written stops the job.

Real broker and worker processes (LeNet, fifo chunks of 100), real `farm submit`
processes killed with SIGKILL, real files: a journal line whose range was
damaged, a tmpfs that fills up mid-job.  Outputs are compared to OpenCV run
in-process on the whole array.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from farm.client import Client, FarmError, JobResult
from farm.journal import journal_path, read_journal
from farm.local import LocalFarm, farm_command
from farm.npy import NpyReader
from tests.conftest import reference_forward

TOTAL = 30_000


@pytest.fixture(scope="module")
def job(lenet, digits) -> tuple[np.ndarray, np.ndarray]:
    """30 000 digits (the sample, repeated) and their reference outputs."""
    return (np.resize(digits, (TOTAL, *digits.shape[1:])),
            np.resize(reference_forward(lenet, digits), (TOTAL, 10)))


@pytest.fixture
def images_file(job, tmp_path) -> Path:
    path = tmp_path / "images.npy"
    np.save(path, job[0])
    return path


def submit(local: LocalFarm, images: Path, out: Path, *extra: str) -> list[str]:
    return farm_command("--log-level", "WARNING", "submit", str(images), "--model", "lenet",
                        "--broker", local.endpoint, "--out", str(out), "--quiet", *extra)


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def journaled(out: Path) -> list[tuple[int, int]]:
    """The ``(start, count)`` ranges out's journal lists (a torn last line left out)."""
    _, entries = read_journal(journal_path(out), TOTAL)
    return [(entry.start, entry.count) for entry in entries]


def journaled_items(out: Path) -> int:
    try:
        return sum(count for _, count in journaled(out))
    except (OSError, ValueError):  # not there yet, or its header not yet whole
        return 0


def number(pattern: str, text: str) -> int:
    """The figure (1,234) that ``pattern``'s group matches in ``text``."""
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return int(found.group(1).replace(",", ""))


def interrupted_job(local: LocalFarm, images: np.ndarray | NpyReader, out: Path) -> JobResult:
    """``Client.run(resume=out)`` cancelled from its progress callback at half-way."""
    with Client(local.endpoint, timeout=60) as client:
        done = [0]

        def progress(count: int) -> None:
            done[0] += count
            if done[0] >= len(images) // 2:
                client.cancel()

        result = client.run(images, "lenet", resume=out, progress=progress)
    assert result.cancelled and result.failed, "the job stopped early"
    return result


def broker_view(local: LocalFarm) -> dict:
    with local.client() as client:
        return client.info()


def test_a_killed_submit_resumes_with_only_the_missing_images(farm_two_workers, job,
                                                              images_file, tmp_path) -> None:
    reference = job[1]
    out = tmp_path / "scores.npy"
    process = subprocess.Popen(submit(farm_two_workers, images_file, out),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (journaled_items(out) < TOTAL // 2 and process.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.002)  # polling a file for a condition, with a deadline
        process.send_signal(signal.SIGKILL)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL, f"the job ended before the kill:\n{stderr}"
    kept = journaled_items(out)
    assert TOTAL // 2 <= kept < TOTAL

    done = run(submit(farm_two_workers, images_file, out, "--resume"))
    assert done.returncode == 0, done.stderr
    resumed = number(r"([\d,]+) images resumed from", done.stdout)
    assert resumed == kept, "every journaled range checked out (a kill loses no written page)"
    assert number(r"; ([\d,]+) submitted", done.stdout) == TOTAL - resumed
    assert number(r"^([\d,]+) images in", done.stdout) == TOTAL - resumed, "the broker ran " \
        "only the missing images"
    np.testing.assert_allclose(np.load(out), reference, atol=1e-5)
    assert not journal_path(out).exists(), "a complete job's journal is deleted"


def test_a_damaged_range_is_recomputed_on_resume(farm_two_workers, job, tmp_path) -> None:
    images, reference = job
    out = tmp_path / "scores.npy"
    first = interrupted_job(farm_two_workers, images, out)
    ranges = journaled(out)
    assert sum(n for _, n in ranges) == TOTAL - sum(f.count for f in first.failed)
    start, count = ranges[len(ranges) // 2]
    reader = NpyReader.open(out)
    offset = reader.offset + (start + count // 2) * reader.item_bytes
    reader.close()
    with open(out, "r+b") as handle:  # flip the bytes of one item of that range
        handle.seek(offset)
        data = handle.read(reader.item_bytes)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in data))
    assert not np.allclose(np.load(out)[start:start + count], reference[start:start + count])

    with Client(farm_two_workers.endpoint, timeout=60) as client:
        result = client.run(images, "lenet", resume=out)
    assert not result.failed and result.duplicates == 0
    assert result.resumed == sum(n for _, n in ranges) - count
    assert result.summary.items == TOTAL - result.resumed, "the damaged range was run again"
    np.testing.assert_allclose(result.outputs, reference, atol=1e-5)
    np.testing.assert_allclose(np.load(out), reference, atol=1e-5)


def test_a_resume_of_another_input_or_model_is_refused(farm_two_workers, job, images_file,
                                                       tmp_path) -> None:
    images, reference = job
    out = tmp_path / "scores.npy"
    interrupted_job(farm_two_workers, NpyReader.open(images_file), out)  # as farm submit
    before = out.read_bytes(), journal_path(out).read_bytes()
    other = tmp_path / "other.npy"
    np.save(other, images[::-1])

    refused = run(submit(farm_two_workers, other, out, "--resume"))
    assert refused.returncode == 2, refused.stderr
    assert "was written for another job" in refused.stderr
    assert "input sha256" in refused.stderr and "model:" not in refused.stderr
    refused = run([*submit(farm_two_workers, images_file, out, "--resume"), "--model",
                   "cifar10_quick"])
    assert refused.returncode == 2, refused.stderr
    assert "model: 'cifar10_quick' here, 'lenet' in the journal" in refused.stderr
    refused = run(submit(farm_two_workers, images_file, out))
    assert refused.returncode == 2, refused.stderr
    assert "add --resume to finish that job, or delete" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (out.read_bytes(), journal_path(out).read_bytes()) == before, "nothing touched"

    journal_path(out).unlink()
    done = run(submit(farm_two_workers, images_file, out, "--resume"))
    assert done.returncode == 0, done.stderr
    assert "no journal at" in done.stderr and "starting afresh" in done.stderr
    assert number(r"^([\d,]+) images in", done.stdout) == TOTAL
    np.testing.assert_allclose(np.load(out), reference, atol=1e-5)


def test_client_map_resumes_after_an_interrupted_call(farm_two_workers, job, tmp_path) -> None:
    images, reference = job
    out = tmp_path / "scores.npy"
    with Client(farm_two_workers.endpoint, timeout=60) as client:
        def cancel_at_half(count: int) -> None:
            cancel_at_half.done += count  # type: ignore[attr-defined]
            if cancel_at_half.done >= TOTAL // 2:  # type: ignore[attr-defined]
                client.cancel()

        cancel_at_half.done = 0  # type: ignore[attr-defined]
        with pytest.raises(FarmError, match="cancelled by the client"):
            client.map(images, "lenet", resume=out, progress=cancel_at_half)
        kept = journaled_items(out)
        assert TOTAL // 2 <= kept < TOTAL

        counts: list[int] = []
        outputs = client.map(images, "lenet", resume=out, progress=counts.append)
    assert counts[0] == kept, "progress starts with the images resumed"
    assert sum(counts[1:]) == TOTAL - kept, "only the missing images were computed"
    assert isinstance(outputs, np.memmap) and Path(outputs.filename) == out.resolve()
    np.testing.assert_allclose(outputs, reference, atol=1e-5)
    assert not journal_path(out).exists()


def test_a_full_disk_cancels_the_job_and_resume_finishes_it(farm_two_workers, job,
                                                            images_file, tmp_path) -> None:
    reference = job[1]
    small = tmp_path / "small"
    small.mkdir()
    # 30 000 outputs of 10 float32 are 1.2 MB; the file is made sparse, so it fills mid-job
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small)],
                           capture_output=True, text=True, check=False)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {mount.stderr}")
    try:
        out = small / "scores.npy"
        cancelled = broker_view(farm_two_workers)["jobs_ended"].get("cancelled", 0)
        failed = run(submit(farm_two_workers, images_file, out))
        assert failed.returncode == 1, failed.stderr
        assert "Traceback" not in failed.stderr
        assert f"cannot write {out}: No space left on device (ENOSPC)" in failed.stderr
        assert "free space and run again with --resume" in failed.stderr
        safe = number(rf"([\d,]+) of {TOTAL:,} images are safely written", failed.stderr)
        assert 0 < safe < TOTAL
        assert journaled_items(out) == safe
        view = broker_view(farm_two_workers)
        assert view["jobs_ended"].get("cancelled", 0) == cancelled + 1, "the job was cancelled"
        assert not view["jobs"], "the broker dropped the job"

        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        done = run(submit(farm_two_workers, images_file, out, "--resume"))
        assert done.returncode == 0, done.stderr
        assert number(r"([\d,]+) images resumed from", done.stdout) == safe
        np.testing.assert_allclose(np.load(out), reference, atol=1e-5)
        assert not journal_path(out).exists()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_torn_or_garbled_journal_line_is_ignored(tmp_path) -> None:
    """No farm: a journal written through JournalSink, then damaged as a kill or a full disk
    would leave it; reopening keeps exactly the whole lines whose bytes check out."""
    from farm.inputs import ArraySource
    from farm.journal import InputIdentity, JournalHeader, JournalSink

    images = np.arange(1000 * 4, dtype=np.uint8).reshape(1000, 1, 2, 2)
    outputs = np.random.default_rng(0).random((1000, 3), dtype=np.float32)
    job = JournalHeader("lenet", InputIdentity.of(ArraySource(images)), ("openvino", "f16"))
    out = tmp_path / "scores.npy"
    sink = JournalSink.open(out, job)
    for start in range(0, 500, 100):
        sink.write(start, outputs[start:start + 100])
    sink.close()
    with open(journal_path(out), "ab") as handle:
        handle.write(b"500 100 12x45\n")  # garbled
        handle.write(b"600 100")  # torn: no newline
    sink = JournalSink.open(out, job)
    assert [(e.start, e.count) for e in sink.resumed] == [(i, 100) for i in range(0, 500, 100)]
    assert sink.resumed_items().sum() == 500 and sink.header.output_shape == (3,)
    sink.write(500, outputs[500:])
    sink.close()
    sink = JournalSink.open(out, job)  # the line after the torn one is whole
    assert sink.resumed[-1].start == 500 and sink.resumed_items().all()
    sink.finish(complete=True)
    sink.close()
    np.testing.assert_array_equal(np.load(out), outputs)
    assert not journal_path(out).exists()
