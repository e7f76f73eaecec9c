"""The farm command: help on every command, and the real commands run end to end."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import click
import numpy as np
import pytest
from click.testing import CliRunner

from farm import defaults
from farm.broker.broker import BrokerConfig
from farm.cli import main
from farm.cli.job import BrokerAccess, output_shape, run_job
from farm.client.inputs import ArraySource
from farm.client.journal import journal_path
from farm.client.npy import partial_path
from farm.client.outputs import OutputSpec
from farm.ops.local import LocalFarm, cores, farm_command
from farm.workers.worker import Device, WorkerConfig
from tests.conftest import reference_forward

COMMANDS = [
    [],
    ["broker"],
    ["worker"],
    ["submit"],
    ["run"],
    ["up"],
    ["down"],
    ["models"],
    ["models", "list"],
    ["models", "show"],
    ["models", "check"],
    ["models", "export"],
    ["models", "prepare"],
    ["models", "add"],
    ["models", "quantize"],
    ["status"],
    ["report"],
    ["bench"],
    ["keys"],
    ["keys", "init"],
    ["keys", "add"],
    ["keys", "list"],
    ["keys", "migrate"],
    ["deploy"],
    ["deploy", "supervisord"],
    ["deploy", "slurm"],
]
#: Libraries no command may load before it runs: ``farm broker --help`` stays fast.
HEAVY = (
    "cv2",
    "torch",
    "onnx",
    "onnxruntime",
    "openvino",
    "matplotlib",
    "tqdm",
    "farm.engines.engine",
)


def command_paths(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """Every command under ``command`` (itself first), as the words that invoke it."""
    yield list(path)
    if isinstance(command, click.Group):
        for name in command.list_commands(CONTEXT):
            sub = command.get_command(CONTEXT, name)
            assert sub is not None, name
            yield from command_paths(sub, (*path, name))


CONTEXT = click.Context(main)


def subcommand(*words: str) -> click.Command:
    """The command ``farm WORDS`` (its module imported, as when it runs)."""
    command: click.Command = main
    for word in words:
        assert isinstance(command, click.Group)
        found = command.get_command(CONTEXT, word)
        assert found is not None, words
        command = found
    return command


def test_every_command_is_registered_and_listed_here() -> None:
    assert sorted(command_paths(main)) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "farm" for c in COMMANDS])
def test_every_command_has_help(command) -> None:
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_help_loads_no_inference_library() -> None:
    code = (
        "import sys\nfrom farm.cli import main\n"
        "try:\n    main(['broker', '--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "command, foreign",
    [
        ("worker", ("farm.client.client", "farm.broker.state", "farm.cli.submit")),
        ("broker", ("farm.client.client", "farm.workers.worker", "farm.cli.submit")),
        ("run", ("farm.broker.state", "farm.workers.worker", "farm.cli.deploy")),
    ],
)
def test_a_command_imports_only_its_own_module(command, foreign) -> None:
    """The other commands' modules are imported when they run, not with every command."""
    code = (
        "import sys\nfrom farm.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(name for name in {foreign!r} if name in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def option_defaults(command: click.Command) -> dict[str, Any]:
    """The values a command runs with when given no option (unset ones left out)."""
    ctx = command.make_context(command.name, [], resilient_parsing=True)
    return {name: value for name, value in ctx.params.items() if value is not None}


def field_defaults(config: type) -> dict[str, Any]:
    return {
        field.name: field.default
        for field in dataclasses.fields(config)
        if field.default is not dataclasses.MISSING
    }


@pytest.mark.parametrize(
    "command, config, shared",
    [
        (
            "broker",
            BrokerConfig,
            {
                "bind",
                "algo",
                "heartbeat",
                "liveness",
                "max_attempts",
                "max_runs",
                "sharing",
                "max_chunk_seconds",
            },
        ),
        # slots: none on either side, each device has its own (test_gpu_worker.py)
        ("worker", WorkerConfig, {"backend", "precision", "heartbeat", "liveness", "curve_name"}),
    ],
)
def test_command_defaults_are_the_configs_defaults(command, config, shared) -> None:
    options, fields = option_defaults(subcommand(command)), field_defaults(config)
    assert shared <= set(options) & set(fields)
    assert {name: options[name] for name in set(options) & set(fields)} == {
        name: fields[name] for name in set(options) & set(fields)
    }


def test_every_part_of_farm_defaults_to_the_same_policy() -> None:
    supervisord = subcommand("deploy", "supervisord")
    assert option_defaults(subcommand("broker"))["algo"] == defaults.POLICY == "equal-finish"
    assert option_defaults(subcommand("run"))["algo"] == defaults.POLICY
    assert option_defaults(supervisord)["algo"] == defaults.POLICY
    assert BrokerConfig().algo == LocalFarm().algo == defaults.POLICY


def test_configs_are_built_by_keyword_only() -> None:
    with pytest.raises(TypeError):
        BrokerConfig(defaults.BROKER_ENDPOINT)
    with pytest.raises(TypeError):
        WorkerConfig(defaults.BROKER_ENDPOINT, Device.parse("cpu"))
    with pytest.raises(TypeError):
        LocalFarm(["cpu"])
    config = WorkerConfig(broker=defaults.BROKER_ENDPOINT, device=Device.parse("cpu"))
    assert config.slots is None and config.device.default_slots == defaults.SLOTS


def test_choices_kept_in_the_cli_match_the_modules_they_name() -> None:
    from farm.benchsuite.peers import PEERS
    from farm.benchsuite.setups import SETUP_NAMES
    from farm.cli.bench import PEER_CHOICES, SETUP_CHOICES
    from farm.cli.options import BACKEND_CHOICES, PRECISION_CHOICES
    from farm.engines.engine import AUTO, BACKENDS, PRECISIONS

    assert BACKEND_CHOICES == (AUTO, *BACKENDS)
    assert PRECISION_CHOICES == PRECISIONS
    assert (SETUP_CHOICES, PEER_CHOICES) == (SETUP_NAMES, PEERS)


def test_models_list_shows_every_bundled_model() -> None:
    result = CliRunner().invoke(main, ["models", "list"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines()[1:]}
    assert "1x28x28" in lines["lenet"] and "32x32x3" in lines["cifar10_quick"]
    assert "227x227x3" in lines["caffenet"]


def test_models_show_lists_layers_and_shapes() -> None:
    result = CliRunner().invoke(main, ["models", "show", "cifar10_quick"])
    assert result.exit_code == 0, result.output
    assert "mean file mean.binaryproto" in result.output and "channel_swap none" in result.output
    assert any(
        line.split()[:4] == ["ip1", "InnerProduct", "64", "64x1024,"]
        for line in result.output.splitlines()
    )


def test_models_check_passes_lenet_and_fails_a_broken_model(tmp_path, lenet) -> None:
    from tests.unit.test_models import break_model

    result = CliRunner().invoke(main, ["models", "check", "lenet", "--count", "16"])
    assert result.exit_code == 0, result.output
    for backend in ("opencv", "onnxruntime", "openvino"):
        assert re.search(rf"{backend} +ok +difference", result.output), result.output
    assert re.search(r"auto on 1 thread\(s\): \w+ f32 batch \d+", result.output)
    break_model(tmp_path / "bad", lenet.folder, "mismatch")
    result = CliRunner().invoke(main, ["models", "check", "bad", "--models-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert re.search("opencv +FAILED", result.output)
    assert "does not match the prototxt" in result.output
    assert "model 'bad' failed its check" in result.output


def test_worker_with_a_missing_backend_says_how_to_install_it() -> None:
    try:
        import caffe  # noqa: F401

        pytest.skip("pycaffe is installed here")
    except ImportError:
        pass
    done = subprocess.run(
        farm_command("worker", "--backend", "caffe"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "pycaffe" in done.stderr and "Traceback" not in done.stderr


def test_submit_writes_outputs_in_order(farm_two_workers, lenet, digits, tmp_path) -> None:
    images, out = tmp_path / "images.npy", tmp_path / "scores.npy"
    np.save(images, digits[:321])
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
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "321 images in" in done.stdout and "waste" in done.stdout
    # stderr is a pipe, not a terminal: a plain progress line, no bar redrawn with \r
    assert re.search(r"^lenet: [\d,]+/321 images \(\d+%\)$", done.stderr, re.MULTILINE)
    assert "\r" not in done.stderr
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits[:321]), atol=1e-5)


def test_submit_reports_a_user_mistake_without_a_traceback(farm_two_workers, tmp_path) -> None:
    images = tmp_path / "images.npy"
    np.save(images, np.zeros((4, 3, 32, 32), np.float32))
    done = subprocess.run(
        farm_command(
            "submit",
            str(images),
            "--model",
            "lenet",
            "--broker",
            farm_two_workers.endpoint,
            "--quiet",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Error: images of shape (3, 32, 32) do not match model 'lenet'" in done.stderr
    assert "Traceback" not in done.stderr


def test_submit_converts_float64_and_big_endian_arrays_to_float32(
    farm_two_workers, lenet, digits, tmp_path
) -> None:
    """numpy's default float64 and a big-endian float32 run as the float32 array does, each
    with one notice; the broker sees float32 (nothing it refuses)."""
    images = digits[:200].astype(np.float32)
    outputs = {}
    for name, dtype in [("f32", "<f4"), ("f64", "<f8"), ("big", ">f4")]:
        path, out = tmp_path / f"{name}.npy", tmp_path / f"{name}-scores.npy"
        np.save(path, images.astype(dtype))
        done = subprocess.run(
            farm_command(
                "submit",
                str(path),
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
        assert done.returncode == 0, done.stderr
        notices = [line for line in done.stderr.splitlines() if "converted" in line]
        assert (
            notices
            == {
                "f32": [],
                "f64": [f"{path}: float64 converted to float32 on the client"],
                "big": [
                    f"{path}: big-endian float32 (>f4) converted to native float32 on the client"
                ],
            }[name]
        )
        outputs[name] = np.load(out)
    np.testing.assert_allclose(outputs["f32"], reference_forward(lenet, images), atol=1e-5)
    for name in ("f64", "big"):
        np.testing.assert_allclose(outputs[name], outputs["f32"], rtol=0, atol=1e-6)


def test_submit_refuses_a_value_float32_cannot_hold_before_submitting(tmp_path) -> None:
    """The refusal comes before any broker is asked: none listens at this address."""
    images = np.zeros((5, 28, 28))
    images[3, 4, 5] = 1e300
    images[1, 0, 0], images[2, 0, 0] = np.inf, np.nan  # the workers' business, not refused
    path = tmp_path / "wide.npy"
    np.save(path, images)
    result = CliRunner().invoke(
        main,
        [
            "submit",
            str(path),
            "--model",
            "lenet",
            "--broker",
            "tcp://127.0.0.1:9",
            "--timeout",
            "5",
            "--quiet",
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"Error: {path}: item 3 holds 1e+300, beyond float32's range (±3.4e+38): float64 "
        f"cannot be converted to float32 without losing it; nothing was submitted"
    )


@pytest.mark.parametrize(
    "images, reason",
    [
        (
            np.zeros((4, 28, 28), np.complex128),
            "complex128 images cannot be sent: farm takes numbers",
        ),
        (
            np.zeros((4, 3, 32, 32), np.float32),
            "images of shape (3, 32, 32) do not match model 'lenet', which takes (1, 28, 28)",
        ),
    ],
    ids=["complex", "shape"],
)
def test_run_refuses_bad_input_before_starting_a_farm(tmp_path, images, reason) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, images)
    result = CliRunner().invoke(main, ["run", str(path), "--model", "lenet", "--quiet"])
    assert result.exit_code == 1, result.output
    assert reason in result.stderr and "Traceback" not in result.output
    assert "starting a local farm" not in result.output


def test_run_starts_a_local_farm_on_the_bundled_sample(lenet, digits, tmp_path) -> None:
    out = tmp_path / "scores.npy"
    done = subprocess.run(
        farm_command("--log-level", "WARNING", "run", "--out", str(out), "--quiet"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert f"{len(digits):,} images in" in done.stdout
    assert "(policy equal-finish)" in done.stdout  # the default
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits), atol=1e-5)


def test_run_passes_policy_parameters_to_its_broker(lenet, digits, tmp_path) -> None:
    out = tmp_path / "scores.npy"
    done = subprocess.run(
        farm_command(
            "--log-level",
            "WARNING",
            "run",
            "--out",
            str(out),
            "--quiet",
            "--algo",
            "fifo",
            "--chunk",
            "500",
        ),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "(policy fifo)" in done.stdout
    if len(cores()) == 2:  # 1000 images, chunks of 500: one each
        assert done.stdout.count(" 50.0% ") == 2, "the two workers should split the sample"
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits), atol=1e-5)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--algo", "fifo", "--probe", "3"], "policy fifo does not take --probe"),
        (["--algo", "fast-split", "--ratio", "0.5,0.5"], "fast-split takes one ratio"),
        (["--algo", "static", "--ratio", "1,x"], "not a number or list of numbers: 1,x"),
        (["--algo", "fast-split", "--ratio", "1.5"], "ratio must be within (0, 1]"),
        (["--algo", "nope"], "'nope' is not one of"),
        (["--algo", "fifo", "--speed-window", "1"], "policy fifo does not take --speed-window"),
    ],
)
def test_broker_refuses_bad_policy_parameters(arguments, message) -> None:
    done = subprocess.run(
        farm_command("broker", "--bind", "tcp://127.0.0.1:*", *arguments),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr


def test_broker_refuses_a_busy_address(farm_two_workers) -> None:
    done = subprocess.run(
        farm_command("broker", "--bind", farm_two_workers.endpoint),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "Address already in use" in done.stderr


@pytest.mark.parametrize(
    "device, reason",
    [
        ("gpu:4096", "device gpu:4096: torch"),
        ("tpu:0", "unsupported device 'tpu:0'"),
        ("cpu:4096", "core 4096 is not available"),
        ("cpu:x", "bad device number"),
    ],
)
def test_worker_rejects_a_device_it_cannot_use(device, reason) -> None:
    done = subprocess.run(
        farm_command("worker", "--device", device), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert reason in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def farm_without_workers(module_local_farm) -> LocalFarm:
    """A broker alone: a job waits there, and no result can ever come back."""
    return module_local_farm(0)


def job_queued(local: LocalFarm) -> bool:
    with local.client() as client:
        return bool(client.info()["jobs"])


def interrupt_once_queued(local: LocalFarm, pid: int) -> threading.Thread:
    """A thread that sends SIGINT to ``pid`` once the broker holds a job (its client installed
    its Ctrl-C handler before it submitted)."""

    def wait_and_interrupt() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if job_queued(local):  # each check is a round trip to the broker
                os.kill(pid, signal.SIGINT)
                return

    thread = threading.Thread(target=wait_and_interrupt, daemon=True)
    thread.start()
    return thread


def test_a_run_cancelled_before_its_first_result_writes_its_nan_rows(
    farm_without_workers, lenet, digits, tmp_path, capsys
) -> None:
    """``farm run``'s path (a plain .npy, the local model's output shape): Ctrl-C before any
    image came back still writes the file it says it writes."""
    out = tmp_path / "s.npy"
    thread = interrupt_once_queued(farm_without_workers, os.getpid())
    with pytest.raises(SystemExit) as stopped:
        run_job(
            BrokerAccess(endpoint=farm_without_workers.endpoint),
            ArraySource(digits[:200]),
            "lenet",
            OutputSpec(path=str(out), journal=False, nan_shape=lambda: output_shape(lenet)),
            quiet=True,
        )
    thread.join()
    assert stopped.value.code == 130
    err = capsys.readouterr().err
    assert "0 of 200 images came back, the other 200 have NaN outputs" in err
    outputs = np.load(out)
    assert outputs.shape == (200, 10) and np.isnan(outputs).all()
    assert not partial_path(out).exists()


def test_a_submit_cancelled_before_its_first_result_says_nothing_was_written(
    farm_without_workers, digits, tmp_path
) -> None:
    """Without the output shape (the broker's model, a journaled .npy), nothing is written,
    and the message says so."""
    images, out = tmp_path / "images.npy", tmp_path / "s.npy"
    np.save(images, digits[:200])
    process = subprocess.Popen(
        farm_command(
            "submit",
            str(images),
            "--model",
            "lenet",
            "--broker",
            farm_without_workers.endpoint,
            "--out",
            str(out),
            "--quiet",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        interrupt_once_queued(farm_without_workers, process.pid).join()
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "no outputs were written: none of the 200 images came back" in stderr
    assert not out.exists() and not partial_path(out).exists()
    assert not journal_path(out).exists()


def test_a_farm_models_entry_that_is_not_a_folder_is_said_where_models_are_searched(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in $FARM_MODELS is said at the start of a command that looks models up (here
    `farm submit`, which then fails on its input), not by `farm models add`, which creates
    the folder."""
    missing = tmp_path / "typo"
    monkeypatch.setenv("FARM_MODELS", str(missing))
    submitted = subprocess.run(
        farm_command("submit", str(tmp_path / "none.npy")), capture_output=True, text=True
    )
    assert submitted.returncode != 0
    assert (
        f"$FARM_MODELS names {missing}, which is not a folder: no models are found there"
        in submitted.stderr
    )
    listed = subprocess.run(farm_command("models", "list"), capture_output=True, text=True)
    assert listed.returncode == 0 and "FARM_MODELS" not in listed.stderr
