"""Outputs never destroy inputs, one job writes a file at a time, and a job says where its
outputs went (or that they were not kept).

Real `farm submit` processes on a real farm (a broker with two LeNet workers, and a broker
alone where a job waits as long as the test wants), real files, links and all.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from farm.cli import main
from farm.cli.job import BrokerAccess, PlainProgress, run_job
from farm.client.client import Client, OutputRefused
from farm.client.inputs import ArraySource
from farm.client.journal import journal_path, lock_path, output_lock
from farm.client.npy import NpyReader, NpyWriter, partial_path
from farm.client.outputs import OutputSpec
from farm.ops.local import LocalFarm, farm_command
from farm.startup import Timeline
from farm.summary import JobSummary, per_second, plural, were
from tests.conftest import reference_forward


@pytest.fixture(scope="module")
def farm_alone(module_local_farm) -> LocalFarm:
    """A broker with no worker: a job submitted there waits until it is cancelled."""
    return module_local_farm(0)


@pytest.fixture
def images(digits, tmp_path) -> Path:
    path = tmp_path / "images.npy"
    np.save(path, digits[:200])
    return path


def farm_submit(endpoint: str, *arguments: str) -> list[str]:
    return farm_command("submit", *arguments, "--model", "lenet", "--broker", endpoint)


def submitted(endpoint: str, *arguments: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A `farm submit` of LeNet run to its end: status, stdout and stderr."""
    return subprocess.run(
        farm_submit(endpoint, *arguments), capture_output=True, text=True, timeout=timeout
    )


def invoke(*arguments: str) -> click.testing.Result:
    """``farm ARGUMENTS`` in this process (a refusal comes before any broker is asked)."""
    return CliRunner().invoke(main, list(arguments))


def folder_state(folder: Path) -> dict[str, bytes]:
    """Every file in ``folder`` (links as they point) and its bytes."""
    return {
        entry.name: (os.readlink(entry).encode() if entry.is_symlink() else entry.read_bytes())
        for entry in sorted(folder.iterdir())
        if entry.is_symlink() or entry.is_file()
    }


def test_submit_refuses_an_out_that_is_its_input(images) -> None:
    """The issue's command, as a real process: exit status 2, the input as it was, no file
    written beside it."""
    before = folder_state(images.parent)
    done = submitted("tcp://127.0.0.1:9", str(images), "--out", str(images), timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"Error: {images} is the job's input: the outputs written there would destroy it" in (
        done.stderr
    )
    assert folder_state(images.parent) == before


@pytest.mark.parametrize("link", ["symbolic", "hard", "partial", "journal"])
def test_an_out_linked_to_the_input_is_refused(images, tmp_path, link) -> None:
    """Through a symbolic or a hard link, and for the files written beside OUT."""
    out = tmp_path / "scores.npy"
    linked = {
        "symbolic": out,
        "hard": out,
        "partial": partial_path(out),
        "journal": journal_path(out),
    }[link]
    if link == "hard":
        os.link(images, linked)
    else:
        linked.symlink_to(images)
    before = folder_state(tmp_path)
    result = invoke("submit", str(images), "--model", "lenet", "--out", str(out))
    assert result.exit_code == 2, result.output
    assert f"{linked} " in result.stderr and f"the same file as the job's input {images}" in (
        result.stderr
    )
    assert folder_state(tmp_path) == before


def test_an_answers_file_linked_to_an_image_or_a_list_is_refused(digits, tmp_path) -> None:
    """Image files (a folder, a list): an answers file that is one of them, or the list."""
    import cv2

    folder = tmp_path / "digits"
    folder.mkdir()
    for index in range(3):
        cv2.imwrite(str(folder / f"{index}.png"), digits[index])
    listing = tmp_path / "list.txt"
    listing.write_text("digits/0.png\n")
    os.link(folder / "2.png", tmp_path / "answers.csv")
    os.link(listing, tmp_path / "other.csv")
    for arguments, out, named in [
        ([str(folder)], "answers.csv", folder / "2.png"),
        ([str(listing)], "other.csv", listing),
    ]:
        result = invoke("submit", *arguments, "--model", "lenet", "--out", str(tmp_path / out))
        assert result.exit_code == 2, result.output
        assert f"the same file as the job's input {named}" in result.stderr


def test_run_refuses_its_input_as_out_before_starting_a_farm(images) -> None:
    result = invoke("run", str(images), "--model", "lenet", "--out", str(images), "--quiet")
    assert result.exit_code == 2, result.output
    assert "is the job's input" in result.stderr
    assert "starting a local farm" not in result.stderr


def test_the_python_client_refuses_its_input_as_output(images, digits) -> None:
    """``resume=`` and an ``NpyWriter``, on a reader or a memory-mapped array:
    OutputRefused before a broker is asked (none listens there), the input whole."""
    before = images.read_bytes()
    with Client("tcp://127.0.0.1:9", timeout=5) as client:
        with pytest.raises(OutputRefused, match="is the job's input"):
            client.run(NpyReader.open(images), "lenet", resume=images)
        with pytest.raises(OutputRefused, match="is the job's input"):
            client.run(NpyReader.open(images), "lenet", out=NpyWriter(images, 200))
        mapped = np.load(images, mmap_mode="r")  # a memory map, and a view of one
        for array in (mapped, mapped[10:20]):
            with pytest.raises(OutputRefused, match="is the job's input"):
                client.run(array, "lenet", resume=images)
    assert images.read_bytes() == before
    assert not partial_path(images).exists() and not lock_path(images).exists()


def broker_holds_a_job(local: LocalFarm) -> bool:
    with local.client() as client:
        return bool(client.info()["jobs"])


def test_the_python_client_guards_its_out_as_farm_submit_does(farm_alone, images, tmp_path) -> None:
    """``Client.run(out=PATH)``, with or without ``resume``: its input refused as PATH, and
    while it runs (on a broker with no worker) it holds ``OUT.lock``: `farm submit --out
    PATH`, with or without --resume, is refused (exit status 2), as is another Python job,
    and nothing is touched; ``cancel(hold=True)`` leaves no file when nothing came back."""
    with Client("tcp://127.0.0.1:9", timeout=5) as client:
        for resume in (False, True):
            with pytest.raises(OutputRefused, match="is the job's input"):
                client.run(NpyReader.open(images), "lenet", out=str(images), resume=resume)
    out, outcome = tmp_path / "same.npy", {}
    client = Client(farm_alone.endpoint, timeout=600)

    def run() -> None:
        try:
            outcome["result"] = client.run(NpyReader.open(images), "lenet", out=out)
        except Exception as exc:  # reported by the test, not lost with the thread
            outcome["error"] = exc

    job = threading.Thread(target=run, daemon=True)
    job.start()
    try:
        while not broker_holds_a_job(farm_alone):  # each look is a round trip to the broker
            assert job.is_alive(), outcome
        before = folder_state(tmp_path)
        submits_are_refused(farm_alone.endpoint, images, out, os.getpid(), tmp_path)
        with Client("tcp://127.0.0.1:9", timeout=5) as other:
            with pytest.raises(OutputRefused, match=f"is writing {out} now"):
                other.run(NpyReader.open(images), "lenet", out=out, resume=True)
        assert folder_state(tmp_path) == before
    finally:
        client.cancel(hold=True)
        job.join(60)
        client.close()
    result = outcome["result"]
    assert result.cancelled and result.held and not result.written, result
    assert not lock_path(out).exists() and not out.exists() and not partial_path(out).exists()


def submits_are_refused(endpoint: str, images: Path, out: Path, holder: int, folder: Path) -> None:
    """`farm submit --out OUT`, with and without --resume, while process ``holder`` writes
    OUT: refused (exit 2, naming the holder), and nothing in ``folder`` changes."""
    before = folder_state(folder)
    for extra in ([], ["--resume"]):
        second = submitted(endpoint, str(images), "--out", str(out), *extra, timeout=60)
        assert second.returncode == 2, second.stderr
        assert (
            f"Error: another job (pid {holder} on {socket.gethostname()}) is writing "
            f"{out} now: wait for it to end" in second.stderr
        )
        assert folder_state(folder) == before


def test_a_second_job_on_the_same_out_is_refused_while_the_first_writes_it(
    farm_alone, images, tmp_path
) -> None:
    """Two real `farm submit`: the first waits on the broker (no worker), holding its
    output's lock; the second, with or without --resume, is refused and touches nothing."""
    out = tmp_path / "same.npy"
    first = subprocess.Popen(
        farm_submit(farm_alone.endpoint, str(images), "--out", str(out), "--timeout", "600"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not broker_holds_a_job(farm_alone):  # each look is a round trip to the broker
            assert first.poll() is None, first.communicate()
        submits_are_refused(farm_alone.endpoint, images, out, first.pid, tmp_path)
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 130, stderr
    assert "no outputs were written: none of the 200 images came back" in stderr
    assert not lock_path(out).exists() and not out.exists() and not partial_path(out).exists()
    with output_lock(out):  # free again
        pass


def test_an_npy_job_without_out_says_its_outputs_are_not_kept(farm_two_workers, images) -> None:
    done = submitted(farm_two_workers.endpoint, str(images), "--quiet")
    assert done.returncode == 0, done.stderr
    assert (
        f"{images}: no --out, so the outputs are not kept (only the summary is shown): add "
        f"--out scores.npy to write them, or --top-k 1 to print each image's top class"
    ) in done.stderr
    assert "200 images in" in done.stdout
    kept = submitted(farm_two_workers.endpoint, str(images), "--quiet", "--top-k", "1")
    assert kept.returncode == 0, kept.stderr
    assert "not kept" not in kept.stderr
    assert re.search(r"^199: \d ", kept.stdout, re.MULTILINE), kept.stdout


@dataclass
class CutShortAtFirstResult(Timeline):
    """A job's timeline that cuts the input file to its first ``keep`` items when the first
    result is written (``run_job`` marks it then): mid-job, at a known point."""

    images: Path = Path()
    keep: int = 0

    def mark(self, stage: str) -> None:
        super().mark(stage)
        if stage == "first result":
            reader = NpyReader.open(self.images)
            os.truncate(self.images, reader.offset + self.keep * reader.item_bytes)
            reader.close()


def test_an_input_cut_short_mid_job_is_named_and_the_job_resumes(
    farm_two_workers, lenet, digits, tmp_path
) -> None:
    """The `.npy` file loses its end while the job runs (fifo chunks of 100, read in
    order): the job stops at the first chunk it cannot read, the error names the file and
    says what to do, and once the file is whole again --resume finishes the job."""
    images, out = tmp_path / "images.npy", tmp_path / "scores.npy"
    np.save(images, np.resize(digits, (3000, *digits.shape[1:])))
    whole = images.read_bytes()
    access = BrokerAccess(endpoint=farm_two_workers.endpoint)
    with pytest.raises(click.ClickException) as stopped:
        run_job(
            access,
            ArraySource(NpyReader.open(images)),
            "lenet",
            OutputSpec(path=str(out)),
            quiet=True,
            timeline=CutShortAtFirstResult(images=images, keep=1500),
        )
    message = stopped.value.message
    assert f"{images} ends " in message and "bytes early" in message, message
    assert "put the whole file back and run the job again" in message
    assert f"the outputs written so far are kept, with {journal_path(out)}" in message
    assert "the same command with --resume" in message
    assert not out.exists() and partial_path(out).exists()
    with farm_two_workers.client() as client:
        assert not client.info()["jobs"], "the job was cancelled on the broker"

    images.write_bytes(whole)
    run_job(
        access,
        ArraySource(NpyReader.open(images)),
        "lenet",
        OutputSpec(path=str(out), resume=True),
        quiet=True,
    )
    reference = np.resize(reference_forward(lenet, digits), (3000, 10))
    np.testing.assert_allclose(np.load(out), reference, atol=1e-5)
    assert not journal_path(out).exists()


def test_counts_of_one_are_singular(farm_two_workers, digits, tmp_path) -> None:
    """The helpers, the summary's lines, and a real job's answers line."""
    assert (plural(1, "image"), plural(2_000, "image")) == ("1 image", "2,000 images")
    assert (per_second(1.2), per_second(0.6), per_second(2400)) == (
        "1 image/s",
        "1 image/s",
        "2,400 images/s",
    )
    assert (were(1), were(3)) == ("1 was", "3 were")
    summary = JobSummary(
        total=1, items=1, items_run=2, failed_attempts=1, lost_attempts=1, seconds=1.0
    ).format()
    assert summary.startswith("1 image in 1.000 s: 1 image/s")
    assert "1 image ran again: 1 attempt failed, 1 was lost with their workers" in summary
    assert PlainProgress(40_000, "lenet", done=12_000).line(24_000) == (
        "lenet: 12,000/40,000 images (30%), 24,000 images/s"
    )
    assert PlainProgress(1, "lenet", done=1).line() == "lenet: 1/1 image (100%)"

    image, out = tmp_path / "one.npy", tmp_path / "one.csv"
    np.save(image, digits[:1])
    done = submitted(farm_two_workers.endpoint, str(image), "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    assert f"answers for 1 image written to {out}" in done.stdout
    assert re.search(r"^1 image in [\d.]+ s: ", done.stdout, re.MULTILINE), done.stdout
