"""Engines chosen in real worker processes: auto's report, a job's own engine, a missing library."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from farm.client.client import FarmError
from farm.engines.autoselect import load_engine
from farm.engines.engine import BACKENDS
from farm.engines.modelcheck import check_inputs
from farm.engines.tolerances import TOLERANCE, relative_difference
from farm.modelrepo.repository import load_spec
from tests.unit.test_engines import (
    ill_conditioned_model,
)


def test_a_missing_library_is_left_out_with_the_package_to_install(tmp_path) -> None:
    """A process where ``import openvino`` fails: auto goes on without it, and asking for it
    by name says what to install."""
    blocker = tmp_path / "blocked" / "openvino"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('openvino is blocked here')\n")
    script = (
        "import json\n"
        "from farm.engines.autoselect import choose, load_engine\n"
        "from farm.modelrepo.repository import ModelError, find\n"
        "choice = choose(find('lenet'), threads=1, use_cache=False)\n"
        "trial = next(t for t in choice.trials if t.backend == 'openvino')\n"
        "try:\n    load_engine(find('lenet'), 'openvino')\n"
        "except ModelError as exc:\n    error = str(exc)\n"
        "print(json.dumps([choice.backend, trial.problem, error]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(blocker.parent)},
        timeout=120,
        check=True,
    )
    backend, problem, error = json.loads(done.stdout.splitlines()[-1])
    assert backend in BACKENDS and backend != "openvino"
    assert problem.startswith("not installed:") and "pip install openvino onnx" in problem
    assert "openvino is blocked here" in error and "pip install openvino onnx" in error


def test_workers_on_auto_report_their_choice_and_refuse_disagreeing_models(
    tmp_path, lenet, digits, local_farm
) -> None:
    from farm.ops.local import farm_command

    ill_conditioned_model(tmp_path / "models" / "ill")
    local = local_farm(2, chunk=100, models_dir=tmp_path / "models", preload=["lenet"])
    with local.client(timeout=60) as client:
        result = client.run(digits[:300, None], "lenet")
        assert not result.failed
        reference = load_engine(lenet, "opencv").run(digits[:300, None])
        assert relative_difference(result.outputs, reference) <= TOLERANCE
        workers = client.info()["workers"]
        assert len(workers) == 2 and all(w["backend"] == "auto" for w in workers)
        for worker in workers:
            backend, precision, _, batch = worker["engines"]["lenet"].split()
            assert backend in BACKENDS and precision == "f32" and int(batch) >= 1
        status = subprocess.run(
            farm_command("status", "--broker", local.endpoint),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "lenet (" in status and " f32 batch " in status

        with pytest.raises(
            FarmError,
            match=r"items 0\.\.2 failed on .*: model 'ill': backends "
            r"opencv and .* disagree",
        ):
            client.run(check_inputs(load_spec(tmp_path / "models" / "ill"), 3), "ill")


def test_farm_run_takes_a_backend_a_precision_and_a_models_dir(tmp_path, lenet, digits) -> None:
    from farm.ops.local import farm_command

    shutil_copy = __import__("shutil").copytree
    shutil_copy(lenet.folder, tmp_path / "models" / "mynet")
    images, out = tmp_path / "images.npy", tmp_path / "out.npy"
    np.save(images, digits[:200, None])
    done = subprocess.run(
        farm_command(
            "run",
            str(images),
            "--model",
            "mynet",
            "--models-dir",
            str(tmp_path / "models"),
            "--backend",
            "openvino",
            "--workers",
            "1",
            "--out",
            str(out),
            "--quiet",
        ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    reference = load_engine(lenet, "opencv").run(digits[:200, None])
    assert relative_difference(np.load(out), reference) <= TOLERANCE
    unknown = subprocess.run(
        farm_command("run", str(images), "--model", "mynet"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 1 and "unknown model 'mynet'" in unknown.stderr


def test_a_job_brings_its_own_engine_and_a_bad_one_is_refused(
    farm_two_workers, lenet, digits
) -> None:
    """Workers on auto run a job that asks for OpenVINO on OpenVINO, beside their own."""
    reference = load_engine(lenet, "opencv").run(digits[:400, None])
    with farm_two_workers.client() as client:
        result = client.run(digits[:400, None], "lenet", backend="openvino")
        assert not result.failed
        assert relative_difference(result.outputs, reference) <= TOLERANCE
        deadline = time.monotonic() + 10  # workers report their engines with each heartbeat
        while not any(
            "openvino f32 batch" in w["engines"]["lenet"] for w in client.info()["workers"]
        ):
            assert time.monotonic() < deadline, client.info()["workers"]
        with pytest.raises(ValueError, match="backend 'tensorflow' is not auto"):
            client.run(digits[:10, None], "lenet", backend="tensorflow")
