"""The farm command: help on every command, and the real commands run end to end."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from typing import Any, Iterator

import click
import numpy as np
import pytest
from click.testing import CliRunner

from farm import defaults
from farm.broker.broker import BrokerConfig
from farm.cli import main
from farm.local import LocalFarm, cores, farm_command
from farm.workers.worker import Device, WorkerConfig
from tests.conftest import reference_forward

COMMANDS = [[], ["broker"], ["worker"], ["submit"], ["run"], ["models"], ["models", "list"],
            ["models", "show"], ["models", "check"], ["models", "export"],
            ["models", "prepare"], ["models", "add"], ["status"], ["report"], ["bench"], ["keys"], ["keys", "init"],
            ["keys", "add"], ["keys", "list"], ["deploy"], ["deploy", "supervisord"],
            ["deploy", "slurm"]]
#: Libraries no command may load before it runs: ``farm broker --help`` stays fast.
HEAVY = ("cv2", "torch", "onnx", "onnxruntime", "openvino", "matplotlib", "tqdm",
         "farm.engine")


def command_paths(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """Every command under ``command`` (itself first), as the words that invoke it."""
    yield list(path)
    for name, sub in getattr(command, "commands", {}).items():
        yield from command_paths(sub, (*path, name))


def test_every_command_is_registered_and_listed_here() -> None:
    assert sorted(command_paths(main)) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "farm" for c in COMMANDS])
def test_every_command_has_help(command) -> None:
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_help_loads_no_inference_library() -> None:
    code = ("import sys\nfrom farm.cli import main\n"
            "try:\n    main(['broker', '--help'])\nexcept SystemExit:\n    pass\n"
            f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def option_defaults(command: click.Command) -> dict[str, Any]:
    """The values a command runs with when given no option (unset ones left out)."""
    ctx = command.make_context(command.name, [], resilient_parsing=True)
    return {name: value for name, value in ctx.params.items() if value is not None}


def field_defaults(config: type) -> dict[str, Any]:
    return {field.name: field.default for field in dataclasses.fields(config)
            if field.default is not dataclasses.MISSING}


@pytest.mark.parametrize("command, config, shared", [
    ("broker", BrokerConfig, {"bind", "algo", "heartbeat", "liveness", "max_attempts", "max_runs",
                              "sharing", "max_chunk_seconds"}),
    # slots: none on either side, each device has its own (test_gpu_worker.py)
    ("worker", WorkerConfig, {"backend", "precision", "heartbeat", "liveness", "curve_name"}),
])
def test_command_defaults_are_the_configs_defaults(command, config, shared) -> None:
    options, fields = option_defaults(main.commands[command]), field_defaults(config)
    assert shared <= set(options) & set(fields)
    assert {name: options[name] for name in set(options) & set(fields)} == \
        {name: fields[name] for name in set(options) & set(fields)}


def test_every_part_of_farm_defaults_to_the_same_policy() -> None:
    supervisord = main.commands["deploy"].commands["supervisord"]
    assert option_defaults(main.commands["broker"])["algo"] == defaults.POLICY == "equal-finish"
    assert option_defaults(main.commands["run"])["algo"] == defaults.POLICY
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
    from farm.bench.peers import PEERS
    from farm.bench.setups import SETUP_NAMES
    from farm.cli.bench import PEER_CHOICES, SETUP_CHOICES
    from farm.cli.options import BACKEND_CHOICES, PRECISION_CHOICES
    from farm.engine import AUTO, BACKENDS, PRECISIONS

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
    assert any(line.split()[:4] == ["ip1", "InnerProduct", "64", "64x1024,"]
               for line in result.output.splitlines())


def test_models_check_passes_lenet_and_fails_a_broken_model(tmp_path, lenet) -> None:
    from tests.test_models import break_model

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
    done = subprocess.run(farm_command("worker", "--backend", "caffe"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "pycaffe" in done.stderr and "Traceback" not in done.stderr


def test_submit_writes_outputs_in_order(farm_two_workers, lenet, digits, tmp_path) -> None:
    images, out = tmp_path / "images.npy", tmp_path / "scores.npy"
    np.save(images, digits[:321])
    done = subprocess.run(farm_command("submit", str(images), "--model", "lenet", "--broker",
                                       farm_two_workers.endpoint, "--out", str(out)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "321 images in" in done.stdout and "waste" in done.stdout
    assert "100%" in done.stderr  # the progress bar ran to the end
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits[:321]), atol=1e-5)


def test_submit_reports_a_user_mistake_without_a_traceback(farm_two_workers, tmp_path) -> None:
    images = tmp_path / "images.npy"
    np.save(images, np.zeros((4, 3, 32, 32), np.float32))
    done = subprocess.run(farm_command("submit", str(images), "--model", "lenet", "--broker",
                                       farm_two_workers.endpoint, "--quiet"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Error: images of shape (3, 32, 32) do not match model 'lenet'" in done.stderr
    assert "Traceback" not in done.stderr


def test_run_starts_a_local_farm_on_the_bundled_sample(lenet, digits, tmp_path) -> None:
    out = tmp_path / "scores.npy"
    done = subprocess.run(farm_command("--log-level", "WARNING", "run", "--out", str(out),
                                       "--quiet"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert f"{len(digits):,} images in" in done.stdout
    assert "(policy equal-finish)" in done.stdout  # the default
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits), atol=1e-5)


def test_run_passes_policy_parameters_to_its_broker(lenet, digits, tmp_path) -> None:
    out = tmp_path / "scores.npy"
    done = subprocess.run(farm_command("--log-level", "WARNING", "run", "--out", str(out),
                                       "--quiet", "--algo", "fifo", "--chunk", "500"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "(policy fifo)" in done.stdout
    if len(cores()) == 2:  # 1000 images, chunks of 500: one each
        assert done.stdout.count(" 50.0% ") == 2, "the two workers should split the sample"
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits), atol=1e-5)


@pytest.mark.parametrize("arguments, message", [
    (["--algo", "fifo", "--probe", "3"], "policy fifo does not take --probe"),
    (["--algo", "fast-split", "--ratio", "0.5,0.5"], "fast-split takes one ratio"),
    (["--algo", "static", "--ratio", "1,x"], "not a number or list of numbers: 1,x"),
    (["--algo", "fast-split", "--ratio", "1.5"], "ratio must be within (0, 1]"),
    (["--algo", "nope"], "'nope' is not one of"),
    (["--algo", "fifo", "--speed-window", "1"], "policy fifo does not take --speed-window"),
])
def test_broker_refuses_bad_policy_parameters(arguments, message) -> None:
    done = subprocess.run(farm_command("broker", "--bind", "tcp://127.0.0.1:*", *arguments),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr


def test_broker_refuses_a_busy_address(farm_two_workers) -> None:
    done = subprocess.run(farm_command("broker", "--bind", farm_two_workers.endpoint),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Address already in use" in done.stderr


@pytest.mark.parametrize("device, reason", [
    ("gpu:4096", "device gpu:4096: torch"), ("tpu:0", "unsupported device 'tpu:0'"),
    ("cpu:4096", "core 4096 is not available"), ("cpu:x", "bad device number")])
def test_worker_rejects_a_device_it_cannot_use(device, reason) -> None:
    done = subprocess.run(farm_command("worker", "--device", device), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert reason in done.stderr and "Traceback" not in done.stderr
