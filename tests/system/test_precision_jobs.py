"""Lower precisions from the command line, with real processes: `farm models quantize`
makes LeNet's int8 version from a calibration `.npy`, and `farm run --precision auto`
runs a real farm in the precision the gate passed, on its own cache."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from farm.ops.local import farm_command
from tests.unit.test_precision import pooling_only


@pytest.fixture()
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def farm(cache: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    environment = {**os.environ, "FARM_CACHE": str(cache)}
    return subprocess.run(
        farm_command(*args), capture_output=True, text=True, timeout=timeout, env=environment
    )


def test_quantize_then_auto_runs_the_farm_in_the_gated_precision(tmp_path, cache, digits) -> None:
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, digits[500:800])
    made = farm(cache, "models", "quantize", "lenet", "--calibration", str(calibration))
    assert made.returncode == 0, made.stderr
    assert "int8 version of lenet: 4 layers quantized on 300 calibration images" in made.stdout

    auto = farm(cache, "run", "--precision", "auto", "--own-farm", "--quiet", "--out",
                str(tmp_path / "auto.npy"))  # fmt: skip
    assert auto.returncode == 0, auto.stderr
    assert "precision gate on 300 validation images" in auto.stderr
    chosen = re.search(r"running in ([\w+]+)", auto.stderr)
    assert chosen is not None, auto.stderr
    ready = next(line for line in auto.stderr.splitlines() if line.startswith("farm ready"))
    assert f" {chosen[1]} batch" in ready  # every worker runs the precision the gate passed
    assert re.search(r"f32.s accuracy 9\d\.\d%", auto.stderr)  # scored on the sample labels
    assert re.search(r"accuracy on the bundled sample: \d", auto.stdout)
    assert "precision auto:" in auto.stderr

    plain = farm(cache, "run", "--own-farm", "--quiet", "--out", str(tmp_path / "f32.npy"))
    assert plain.returncode == 0, plain.stderr
    outputs, reference = np.load(tmp_path / "auto.npy"), np.load(tmp_path / "f32.npy")
    agreement = (outputs[:300].argmax(1) == reference[:300].argmax(1)).mean()
    assert agreement >= 0.99  # what the gate vouched for, on its validation images
    assert chosen[1] == "f32" or not np.array_equal(outputs, reference)

    check = farm(cache, "models", "check", "lenet", "--count", "2")
    assert check.returncode == 0, check.stderr
    assert "int8 version of lenet" in check.stdout
    assert "remembered gate on validation set" in check.stdout


def test_a_cascade_job_answers_as_f32_and_counts_its_reruns(
    tmp_path, cache, digits, monkeypatch
) -> None:
    """int8 calibrated on blank images changes many LeNet answers; the cascade with the
    margin fitted on the sample runs those again in f32 on the workers, so every answer is
    f32's, and the job says how many ran again.  int8 runs on any x86-64."""
    from farm.engines.autoselect import load_engine
    from farm.engines.cascade import changed, fit_margin, in_doubt
    from farm.modelrepo.repository import find

    blank = tmp_path / "blank.npy"
    np.save(blank, np.zeros((100, *digits.shape[1:]), np.uint8))
    made = farm(cache, "models", "quantize", "lenet", "--calibration", str(blank))
    assert made.returncode == 0, made.stderr
    monkeypatch.setenv("FARM_CACHE", str(cache))
    lenet, images = find("lenet"), digits[:, np.newaxis]
    fast = load_engine(lenet, "openvino", threads=1, precision="int8").run(images)
    exact = load_engine(lenet, "openvino", threads=1).run(images)
    assert changed(fast, exact).mean() > 0.05  # a real set of doubts
    margin = fit_margin(fast, exact) * 1.01  # clear of the last bits of another batching
    expected = int(in_doubt(fast, margin).sum())

    cascade = farm(cache, "run", "--backend", "openvino", "--precision", f"int8+f32={margin}",
                   "--own-farm", "--out", str(tmp_path / "cascade.npy"))  # fmt: skip
    assert cascade.returncode == 0, cascade.stderr
    outputs = np.load(tmp_path / "cascade.npy")
    assert (outputs.argmax(1) == exact.argmax(1)).all()
    assert not np.allclose(outputs, exact)  # the images not in doubt kept int8's outputs
    found = re.search(r"cascade: ([\d,]+) images \((\d+\.\d)% of 1,000\) run again in f32",
                      cascade.stdout)  # fmt: skip
    assert found is not None, cascade.stdout
    assert abs(int(found[1].replace(",", "")) - expected) <= 0.02 * len(images)
    ready = next(line for line in cascade.stderr.splitlines() if line.startswith("farm ready"))
    assert "int8+f32 batch" in ready

    folder = tmp_path / "digits"  # image files: the re-runs are counted per file
    folder.mkdir()
    for index in range(120):
        cv2.imwrite(str(folder / f"{index:03d}.png"), digits[index])
    (folder / "120.png").write_bytes(b"not a png")
    files = farm(cache, "run", str(folder), "--backend", "openvino", "--precision",
                 f"int8+f32={margin}", "--own-farm",
                 "--out", str(tmp_path / "files.csv"))  # fmt: skip
    assert files.returncode == 1 and "120.png: not an image file" in files.stderr  # alone
    found = re.search(r"cascade: ([\d,]+) images? \([\d.]+% of 120\)", files.stdout)
    assert found is not None, files.stdout
    assert abs(int(found[1]) - int(in_doubt(fast[:120], margin).sum())) <= 3

    unknown = farm(cache, "run", "--precision", "int8+f32=x", "--quiet")
    assert unknown.returncode == 2 and "a cascade's margin is a number >= 0" in unknown.stderr
    anywhere = farm(cache, "run", "--precision", "int8+f32=0.5", "--own-farm", "--quiet")
    assert anywhere.returncode != 0 and "a cascade runs on a named backend" in anywhere.stderr


def test_quantize_refuses_a_calibration_set_too_small(tmp_path, cache, digits) -> None:
    few = tmp_path / "few.npy"
    np.save(few, digits[:40])
    done = farm(cache, "models", "quantize", "lenet", "--calibration", str(few))
    assert done.returncode == 1
    assert "40 calibration images are too few" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (cache / "onnx").exists() or not list((cache / "onnx").glob("*int8*"))


def test_a_net_with_no_int8_layer_is_told_it_stays_in_f32(tmp_path, cache) -> None:
    spec = pooling_only(tmp_path / "models" / "pooling")
    images = tmp_path / "images.npy"
    np.save(images, np.random.default_rng(0).integers(0, 256, (120, 28, 28), np.uint8))
    done = farm(cache, "models", "quantize", "pooling", "--calibration", str(images),
                "--models-dir", str(spec.folder.parent))  # fmt: skip
    assert done.returncode == 1
    assert "model 'pooling' stays in f32: no layer of the net has an int8 kernel" in done.stderr
    assert "Traceback" not in done.stderr


def test_int8_without_a_quantized_version_is_one_line_before_any_farm(cache) -> None:
    done = farm(cache, "run", "--model", "cifar10_quick", "--precision", "int8", "--quiet")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "Error: model 'cifar10_quick' has no int8 version here: make one with `farm models "
        "quantize cifar10_quick --calibration IMAGES`, or use --precision auto"
    ]


def test_gate_options_without_auto_are_refused(cache, tmp_path) -> None:
    done = farm(cache, "run", "--validate", str(tmp_path), "--quiet")
    assert done.returncode == 2
    assert "--validate and --min-agreement go with auto or a cascade" in done.stderr


SIGNAL_STACK_PROBE = """
import ctypes
import numpy as np
from farm.engines.autoselect import load_engine
from farm.engines.engine import SignalStack
from farm.modelrepo.repository import find

def stack():
    found = SignalStack()
    ctypes.CDLL("libc.so.6").sigaltstack(None, ctypes.byref(found))
    return found.ss_sp or 0, found.ss_flags, found.ss_size

before = stack()
lenet = find("lenet")
engine = load_engine(lenet, "openvino", threads=1)
engine.run(np.load(lenet.sample)[:64, np.newaxis])
print(before, stack())
"""


def run_probe(probe: str, cache: Path, timeout: float) -> subprocess.CompletedProcess:
    """``probe`` run by a fresh Python with ``cache`` as its $FARM_CACHE."""
    environment = {**os.environ, "FARM_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=environment,
        timeout=timeout,
    )  # fmt: skip


def test_compiling_with_openvino_leaves_the_signal_stack_as_it_was(cache) -> None:
    """OpenVINO gives the compiling thread a signal stack of its own, freed with the net;
    Python runs its handlers on it.  farm gives the thread its own back (a fresh process:
    pytest's faulthandler already holds one, and OpenVINO then adds none)."""
    done = run_probe(SIGNAL_STACK_PROBE, cache, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.strip().split(") (")
    assert before + ")" == "(0, 2, 0)" and "(" + after == "(0, 2, 0)", done.stdout


def test_ctrl_c_after_the_gate_cancels_the_job(tmp_path, cache, digits) -> None:
    """The gate compiles and drops nets in farm run's own process before the job; Ctrl-C
    in the job then cancels it (exit status 130), as without the gate."""
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, digits[500:800])
    assert (
        farm(cache, "models", "quantize", "lenet", "--calibration", str(calibration)).returncode
        == 0
    )
    environment = {**os.environ, "FARM_CACHE": str(cache)}
    process = subprocess.Popen(
        farm_command("run", "--precision", "auto", "--repeat", "100000", "--own-farm"),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=environment,
    )
    assert process.stderr is not None
    seen = b""
    while not re.search(rb"lenet: [1-9][0-9,]*/[0-9,]+ images", seen):  # images came back
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, seen.decode()
        seen += chunk
    process.send_signal(signal.SIGINT)
    rest = process.stderr.read().decode()
    assert process.wait(timeout=60) == 130, seen.decode() + rest
    assert "job stopped: cancelled by the client" in rest


GATE_PROBE = """
import sys
import numpy as np
from farm.engines.gate import judge_input
from farm.modelrepo.repository import find

lenet = find("lenet")
digits = np.load(lenet.sample)[:300, np.newaxis]
first = judge_input(lenet, "probe", lambda: (digits, None))
again = judge_input(lenet, "probe", lambda: (digits, None))
loaded = [name for name in ("openvino", "onnxruntime", "torch") if name in sys.modules]
print(first.cached, again.cached, first.verdicts == again.verdicts, loaded)
"""


def test_the_gate_of_a_farm_command_keeps_inference_libraries_out_of_it(cache) -> None:
    """farm run forks its farm after the gate: the gate measures in a process of its own,
    and its remembered verdicts are read without importing an engine."""
    done = run_probe(GATE_PROBE, cache, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "False True True []", done.stdout
