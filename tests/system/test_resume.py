"""A killed client resumes from its journal; an output that cannot be written stops the job.

Real broker and worker processes (LeNet, fifo chunks of 100), real `farm submit`
and `farm run` processes killed with SIGKILL, real files: a journal line whose
range was damaged, a torn answers row, a tmpfs that fills up mid-job.  Outputs
are compared to OpenCV run in-process on the whole array, answers files to an
uninterrupted run's, byte for byte.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from inotify_simple import INotify, flags

from farm.client.answerjournal import AnswersJournal, parse_marks
from farm.client.answers import ModelCard
from farm.client.client import Client, FarmError, JobResult
from farm.client.inputs import ArraySource
from farm.client.journal import InputIdentity, JournalHeader, journal_path, read_journal, read_lines
from farm.client.npy import NpyReader, partial_path
from farm.ops.local import LocalFarm, farm_command
from tests.conftest import reference_forward

TOTAL = 30_000


@pytest.fixture(scope="module")
def job(lenet, digits) -> tuple[np.ndarray, np.ndarray]:
    """30 000 digits (the sample, repeated) and their reference outputs."""
    return (
        np.resize(digits, (TOTAL, *digits.shape[1:])),
        np.resize(reference_forward(lenet, digits), (TOTAL, 10)),
    )


@pytest.fixture
def images_file(job, tmp_path) -> Path:
    path = tmp_path / "images.npy"
    np.save(path, job[0])
    return path


def submit(local: LocalFarm, images: Path, out: Path, *extra: str) -> list[str]:
    return farm_command(
        "--log-level",
        "WARNING",
        "submit",
        str(images),
        "--model",
        "lenet",
        "--broker",
        local.endpoint,
        "--out",
        str(out),
        "--quiet",
        *extra,
    )


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


def journaled_rows(out: Path) -> int:
    """The rows an answers file's journal vouches for (0 while it has no whole header)."""
    try:
        _, lines = read_lines(journal_path(out))
    except (OSError, ValueError):
        return 0
    marks = parse_marks(lines, TOTAL)
    return marks[-1].rows if marks else 0


def kill_when(process: subprocess.Popen, ready: Callable[[], bool], folder: Path) -> str:
    """SIGKILL ``process`` once ``ready()`` holds, checked again at each change to a file in
    ``folder`` (where the job writes); its stderr.  Fails if it ended first."""
    stderr = signal_when(process, ready, folder, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL, f"the job ended before the kill:\n{stderr}"
    return stderr


def signal_when(
    process: subprocess.Popen, ready: Callable[[], bool], folder: Path, signum: int
) -> str:
    """Send ``signum`` to ``process`` once ``ready()`` holds, checked again at each change to
    a file in ``folder``; its stderr once it has ended (TimeoutExpired, and killed, if it
    runs on for 60 s)."""
    try:
        with INotify() as changes:
            changes.add_watch(folder, flags.CREATE | flags.MODIFY | flags.MOVED_TO)
            exited = os.pidfd_open(process.pid)  # readable once the process has ended
            try:
                deadline = time.monotonic() + 120
                while not ready() and process.poll() is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    select.select([changes, exited], [], [], left)
                    changes.read(timeout=0)
            finally:
                os.close(exited)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return stderr


def number(pattern: str, text: str) -> int:
    """The figure (1,234) that ``pattern``'s group matches in ``text``."""
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return int(found.group(1).replace(",", ""))


def assert_only_the_rest_ran(stdout: str, missing: int) -> None:
    """The resumed job ran only the ``missing`` images: all of them, but those whose results
    the killed client's workers finished and the broker kept for the resumption."""
    kept = r"([\d,]+) images came back from results the workers kept"
    from_kept = number(kept, stdout) if re.search(kept, stdout) else 0
    ran = number(r"^([\d,]+) images in", stdout)
    assert missing - from_kept <= ran <= missing, f"only the rest ran:\n{stdout}"


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


@pytest.mark.parametrize("earlier", [False, True], ids=["no-earlier-file", "earlier-file"])
def test_a_killed_submit_resumes_with_only_the_missing_images(
    farm_two_workers, job, images_file, tmp_path, earlier
) -> None:
    """The killed job leaves ``OUT.partial`` and its journal, never an ``OUT`` that reads as
    complete (an earlier job's ``OUT`` stays as it was until the resume's rename)."""
    reference = job[1]
    out = tmp_path / "scores.npy"
    if earlier:
        np.save(out, reference[::-1])
    before = out.read_bytes() if earlier else None
    process = subprocess.Popen(
        submit(farm_two_workers, images_file, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_when(process, lambda: journaled_items(out) >= TOTAL // 2, out.parent)
    kept = journaled_items(out)
    assert TOTAL // 2 <= kept < TOTAL
    assert (out.read_bytes() if out.exists() else None) == before, "OUT untouched"
    assert partial_path(out).exists() and journal_path(out).exists()

    done = run(submit(farm_two_workers, images_file, out, "--resume"))
    assert done.returncode == 0, done.stderr
    resumed = number(r"([\d,]+) images resumed from", done.stdout)
    assert resumed == kept, "every journaled range checked out (a kill loses no written page)"
    assert_only_the_rest_ran(done.stdout, TOTAL - resumed)
    assert number(r"; ([\d,]+) submitted", done.stdout) == number(
        r"^([\d,]+) images in", done.stdout
    )
    np.testing.assert_allclose(np.load(out), reference, atol=1e-5)
    assert not journal_path(out).exists(), "a complete job's journal is deleted"
    assert not partial_path(out).exists(), "renamed to OUT"


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
    assert not np.allclose(np.load(out)[start : start + count], reference[start : start + count])

    with Client(farm_two_workers.endpoint, timeout=60) as client:
        result = client.run(images, "lenet", resume=out)
    assert not result.failed and result.duplicates == 0
    assert result.resumed == sum(n for _, n in ranges) - count
    assert result.summary.items == TOTAL - result.resumed, "the damaged range was run again"
    np.testing.assert_allclose(result.outputs, reference, atol=1e-5)
    np.testing.assert_allclose(np.load(out), reference, atol=1e-5)


def test_a_resume_of_another_input_or_model_is_refused(
    farm_two_workers, job, images_file, tmp_path
) -> None:
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
    refused = run(
        [*submit(farm_two_workers, images_file, out, "--resume"), "--model", "cifar10_quick"]
    )
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


def test_a_full_disk_cancels_the_job_and_resume_finishes_it(
    farm_two_workers, job, images_file, tmp_path
) -> None:
    reference = job[1]
    small = tmp_path / "small"
    small.mkdir()
    # 30 000 outputs of 10 float32 are 1.2 MB; the file is made sparse, so it fills mid-job
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {mount.stderr}")
    try:
        out = small / "scores.npy"
        cancelled = broker_view(farm_two_workers)["jobs_ended"].get("cancelled", 0)
        failed = run(submit(farm_two_workers, images_file, out))
        assert failed.returncode == 1, failed.stderr
        assert "Traceback" not in failed.stderr
        assert f"cannot write {out}.partial: No space left on device (ENOSPC)" in failed.stderr
        assert not out.exists(), "a job that could not write every row leaves no OUT"
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
    from farm.client.inputs import ArraySource
    from farm.client.journal import InputIdentity, JournalHeader, JournalSink
    from farm.wire.engines import EngineChoice

    images = np.arange(1000 * 4, dtype=np.uint8).reshape(1000, 1, 2, 2)
    outputs = np.random.default_rng(0).random((1000, 3), dtype=np.float32)
    engine = EngineChoice("openvino", ("f16",))
    job = JournalHeader("lenet", InputIdentity.of(ArraySource(images)), engine)
    out = tmp_path / "scores.npy"
    sink = JournalSink.open(out, job)
    for start in range(0, 500, 100):
        sink.write(start, outputs[start : start + 100])
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


@pytest.fixture(scope="module")
def shared_images(job, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("answers") / "images.npy"
    np.save(path, job[0])
    return path


@pytest.fixture(scope="module")
def farm_one_batch_per_chunk(module_local_farm) -> LocalFarm:
    """As ``farm_two_workers``, but each chunk of 100 computed as one batch of 100 on one
    backend, whichever worker takes it: the same chunk gives the same bits, so answers
    files compare byte for byte (a worker's own batch or backend choice may differ from the
    other's in the last bit: ``auto`` times them, and a loaded machine's timings vary)."""
    return module_local_farm(
        2, chunk=100, worker_options=["--batch", "100", "--backend", "openvino"], preload=["lenet"]
    )


@pytest.fixture(scope="module")
def fresh_answers(farm_one_batch_per_chunk, shared_images, tmp_path_factory) -> dict[str, bytes]:
    """The answers files of uninterrupted jobs (top 5), by suffix."""
    folder = tmp_path_factory.mktemp("fresh")
    files = {}
    for suffix in ("csv", "jsonl"):
        out = folder / f"answers.{suffix}"
        done = run(submit(farm_one_batch_per_chunk, shared_images, out))
        assert done.returncode == 0, done.stderr
        assert not journal_path(out).exists() and not partial_path(out).exists()
        files[suffix] = out.read_bytes()
    return files


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_a_killed_answers_job_resumes_to_the_same_bytes(
    farm_one_batch_per_chunk, shared_images, fresh_answers, tmp_path, suffix
) -> None:
    farm = farm_one_batch_per_chunk
    out = tmp_path / f"answers.{suffix}"
    process = subprocess.Popen(
        submit(farm, shared_images, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_when(process, lambda: journaled_rows(out) >= TOTAL // 2, out.parent)
    kept = journaled_rows(out)
    assert TOTAL // 2 <= kept < TOTAL
    assert not out.exists() and partial_path(out).exists() and journal_path(out).exists()
    before = partial_path(out).read_bytes(), journal_path(out).read_bytes()

    refused = run(submit(farm, shared_images, out))
    assert refused.returncode == 2, refused.stderr
    assert f"({partial_path(out)} holds its outputs so far)" in refused.stderr
    assert "add --resume to finish that job" in refused.stderr
    refused = run(submit(farm, shared_images, out, "--resume", "--top-k", "3"))
    assert refused.returncode == 2, refused.stderr
    assert "top-k: 3 here, 5 in the journal" in refused.stderr
    assert (partial_path(out).read_bytes(), journal_path(out).read_bytes()) == before

    done = run(submit(farm, shared_images, out, "--resume"))
    assert done.returncode == 0, done.stderr
    assert number(r"([\d,]+) images resumed from", done.stdout) == kept
    assert_only_the_rest_ran(done.stdout, TOTAL - kept)
    assert out.read_bytes() == fresh_answers[suffix]
    assert not journal_path(out).exists() and not partial_path(out).exists()


def test_a_stopped_answers_job_is_whole_and_its_resume_retries_the_rest(
    farm_one_batch_per_chunk, shared_images, fresh_answers, lenet, tmp_path
) -> None:
    """Cancelled at half-way: ``OUT`` is renamed whole (the rest's rows say why), its journal
    vouches only for the rows that came back; ``--resume`` takes ``OUT`` back and finishes
    it as an uninterrupted job would have."""
    farm = farm_one_batch_per_chunk
    out = tmp_path / "answers.csv"
    source = ArraySource(NpyReader.open(shared_images))
    header = JournalHeader("lenet", InputIdentity.of(source), None, format="csv", top_k=5)
    sink = AnswersJournal.open(out, header, ModelCard(lenet.labels, lenet.softmax), source.names)
    with Client(farm.endpoint, timeout=60) as client:
        done = [0]

        def progress(count: int) -> None:
            done[0] += count
            if done[0] >= TOTAL // 2:
                client.cancel()

        try:
            result = client.run(source, "lenet", out=sink, progress=progress)
        finally:
            sink.close()
    assert result.cancelled and result.failed
    lines = out.read_text().splitlines()
    assert len(lines) == 1 + TOTAL and lines[-1].endswith(",cancelled by the client")
    kept = journaled_rows(out)  # the rows written in order before the cancel
    assert 0 < kept < TOTAL and not partial_path(out).exists()

    resumed = run(submit(farm, shared_images, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert number(r"([\d,]+) images resumed from", resumed.stdout) == kept
    assert out.read_bytes() == fresh_answers["csv"]
    assert not journal_path(out).exists()


def test_a_torn_answers_row_is_cut_on_resume(tmp_path) -> None:
    """No farm: answers journaled through AnswersJournal, then a row torn and a journal line
    garbled as a kill would leave them; the resume cuts the file at the last row its journal
    vouches for, and the file ends as one written in one go."""
    images = np.zeros((10, 1, 2, 2), np.uint8)
    scores = np.random.default_rng(0).random((10, 3), dtype=np.float32)
    source = ArraySource(images)
    card = ModelCard(("zero", "one", "two"))
    header = JournalHeader("net", InputIdentity.of(source), None, format="csv", top_k=2)
    out, whole = tmp_path / "answers.csv", tmp_path / "whole.csv"
    for path in (out, whole):
        sink = AnswersJournal.open(path, header, card, source.names)
        sink.write(0, scores[:4])
        if path == whole:
            sink.write(4, scores[4:])
            sink.finish(complete=True)
        sink.close()
    assert not journal_path(whole).exists() and whole.read_text().count("\n") == 11
    with open(partial_path(out), "ab") as handle:
        handle.write(b"4,0,zero,0.4")  # a torn row
    with open(journal_path(out), "ab") as handle:
        handle.write(b"5 99x 12\n")  # garbled
        handle.write(b"6 100000 12\n")  # past the file's end: its rows never reached it

    sink = AnswersJournal.open(out, header, card, source.names)
    assert sink.resumed_items().sum() == 4 and sink.safe == 4
    sink.write(4, scores[4:])
    sink.finish(complete=True)
    sink.close()
    assert out.read_bytes() == whole.read_bytes()
    assert not journal_path(out).exists() and not partial_path(out).exists()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a local farm's broker and workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # not a process, or gone
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def farm_run(images: Path, out: Path, *extra: str) -> list[str]:
    """``farm run`` of LeNet on one pinned worker, fifo chunks of 100."""
    return farm_command(
        "--log-level",
        "WARNING",
        "run",
        str(images),
        "--model",
        "lenet",
        "--out",
        str(out),
        "--workers",
        "1",
        "--algo",
        "fifo",
        "--chunk",
        "100",
        *extra,
    )


def test_a_killed_farm_run_leaves_only_its_partial_file(images_file, tmp_path) -> None:
    """``farm run --out x.npy`` killed mid-job leaves ``x.npy.partial`` and its journal;
    the earlier ``x.npy`` is as it was."""
    out = tmp_path / "x.npy"
    np.save(out, np.arange(3))
    before = out.read_bytes()
    with open(tmp_path / "run.log", "w") as log:  # not a pipe: the orphans would hold it
        process = subprocess.Popen(
            farm_run(images_file, out, "--quiet"),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    farm: list[int] = []

    def first_result_written() -> bool:
        if partial_path(out).exists():
            farm.extend(children(process.pid))  # before the kill orphans them
            return True
        return False

    try:
        kill_when(process, first_result_written, out.parent)
    finally:
        for pid in farm:
            os.kill(pid, signal.SIGKILL)
    assert farm, (tmp_path / "run.log").read_text()
    assert out.read_bytes() == before
    assert partial_path(out).exists() and journal_path(out).exists()


def test_an_interrupted_farm_run_resumes_to_a_whole_output(job, images_file, tmp_path) -> None:
    """Ctrl-C (SIGINT) once the first range is journaled: no file under the final name, its
    ``.partial`` and journal kept; ``farm run --resume`` submits only the rest, and the
    output is an uninterrupted run's.  stderr is a file: plain progress lines, no bar."""
    out = tmp_path / "scores.npy"
    logs = [tmp_path / "interrupted.log", tmp_path / "resumed.log"]
    with open(logs[0], "w") as log:
        process = subprocess.Popen(
            farm_run(images_file, out), stdout=subprocess.DEVNULL, stderr=log, text=True
        )
    signal_when(process, lambda: journaled_items(out) > 0, out.parent, signal.SIGINT)
    interrupted = logs[0].read_text()
    assert process.returncode == 130, interrupted
    kept = journaled_items(out)
    assert 0 < kept < TOTAL
    assert not out.exists() and partial_path(out).exists() and journal_path(out).exists()
    assert (
        f"of {TOTAL:,} images came back, kept in {partial_path(out)}; the same command "
        f"with --resume submits the other"
    ) in interrupted

    refused = run(farm_run(images_file, out))
    assert refused.returncode == 2, refused.stderr
    assert "add --resume to finish that job" in refused.stderr
    assert "starting a local farm" not in refused.stderr, "refused before a farm started"

    with open(logs[1], "w") as log:
        done = subprocess.run(
            farm_run(images_file, out, "--resume"),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=180,
            check=False,
        )
    assert done.returncode == 0, logs[1].read_text()
    assert number(r"([\d,]+) images resumed from", done.stdout) == kept
    assert_only_the_rest_ran(done.stdout, TOTAL - kept)
    np.testing.assert_allclose(np.load(out), job[1], atol=1e-5)
    assert not journal_path(out).exists() and not partial_path(out).exists()
    for log_file in logs:
        text = log_file.read_text()
        assert "\r" not in text, "no progress bar in a file"
        assert re.search(
            rf"^lenet: [\d,]+/{TOTAL:,} images \(\d+%\)(, [\d,]+ images?/s)?$", text, re.MULTILINE
        ), text


def test_a_journal_of_rotated_photos_does_not_resume_a_job_that_keeps_stored_pixels(
    tmp_path: Path,
) -> None:
    """No farm: the journal records whether image files were turned upright by their EXIF
    orientation, and a resume that asks otherwise is refused (its rows would mix both)."""
    from farm.client.journal import JournalMismatch, JournalSink

    images = np.zeros((10, 1, 2, 2), dtype=np.uint8)
    identity = InputIdentity.of(ArraySource(images))
    upright = JournalHeader("squeezenet", identity, None, exif_rotate=True)
    parsed = JournalHeader.parse(upright.line())
    assert parsed.exif_rotate is True and not parsed.differences(upright)
    out = tmp_path / "scores.npy"
    sink = JournalSink.open(out, upright)
    sink.write(0, np.ones((5, 3), dtype=np.float32))
    sink.close()
    stored = JournalHeader("squeezenet", identity, None, exif_rotate=False)
    with pytest.raises(JournalMismatch, match="EXIF orientation applied: False here, True in"):
        JournalSink.open(out, stored)
    assert JournalSink.open(out, upright).resumed_items().sum() == 5


def test_the_exif_choice_is_journaled_for_image_files_only(tmp_path: Path) -> None:
    """The CLI and the Python client build the journal header alike: the EXIF choice
    counts for image files, and arrays journal none."""
    from farm.client.inputs import open_input

    photo = tmp_path / "one.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)  # hashed, never decoded here
    files = open_input([str(photo)])
    assert JournalHeader.of_job("m", files, None, False).exif_rotate is False
    assert JournalHeader.of_job("m", files, None, True).exif_rotate is True
    array = ArraySource(np.zeros((3, 1, 2, 2), dtype=np.uint8))
    assert JournalHeader.of_job("m", array, None, False).exif_rotate is None


def test_a_journal_written_before_the_engine_struct_still_resumes(tmp_path: Path) -> None:
    """No farm: journals of earlier versions record the engine as ``[backend, precision]``;
    they are read as the same choice, so an upgrade mid-job keeps what was computed."""
    import json

    from farm.client.journal import JournalSink
    from farm.wire.engines import EngineChoice

    identity = InputIdentity.of(ArraySource(np.zeros((10, 1, 2, 2), dtype=np.uint8)))
    choice = EngineChoice.parse("openvino", "bf16")
    header = JournalHeader("lenet", identity, choice)
    out = tmp_path / "scores.npy"
    sink = JournalSink.open(out, header)
    sink.write(0, np.ones((5, 3), dtype=np.float32))
    sink.close()
    journal = journal_path(out)
    first, rest = journal.read_bytes().split(b"\n", 1)
    document = json.loads(first)
    document["engine"] = ["openvino", "bf16"]  # the form written before the struct
    journal.write_bytes(json.dumps(document).encode() + b"\n" + rest)
    assert JournalHeader.parse(json.dumps(document).encode()).engine == choice
    resumed = JournalSink.open(out, header)
    assert resumed.resumed_items().tolist() == [True] * 5 + [False] * 5
    resumed.close()
