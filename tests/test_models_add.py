"""``farm models add``: a user's Caffe files become a checked model, or nothing at all."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from farm.local import farm_command
from farm.modelstore import manifest_of
from farm.repository import add_target, find, search_path, user_models_dir

#: The real SqueezeNet v1.0 (ImageNet), read from the shared folder beside the repository.
SQUEEZENET = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "squeezenet_v1.0"


def add(repository: Path, *args: str) -> subprocess.CompletedProcess:
    """``farm models add ARGS`` with ``repository`` as $FARM_MODELS."""
    return subprocess.run(farm_command("models", "add", *args, "--count", "2"),
                          env={**os.environ, "FARM_MODELS": str(repository)},
                          capture_output=True, text=True, timeout=120)


def lenet_files(lenet) -> list[str]:
    return ["--prototxt", str(lenet.prototxt), "--weights", str(lenet.weights)]


@pytest.mark.skipif(not (SQUEEZENET / "squeezenet_v1.0.caffemodel").is_file(),
                    reason=f"the shared SqueezeNet is not at {SQUEEZENET}")
def test_add_squeezenet_with_its_labels(tmp_path) -> None:
    repository = tmp_path / "models"
    done = add(repository, "squeezenet", "--prototxt", str(SQUEEZENET / "deploy.prototxt"),
               "--weights", str(SQUEEZENET / "squeezenet_v1.0.caffemodel"), "--mean",
               "104,117,123", "--labels", str(SQUEEZENET / "synset_words.txt"), "--resize",
               "256", "--crop", "center")
    assert done.returncode == 0, done.stderr
    assert "opencv      ok" in done.stdout and "DIFFERS" not in done.stdout
    assert "next: farm run photos/ --model squeezenet --top-k 5" in done.stdout
    spec = find("squeezenet", [repository])
    assert len(spec.labels) == 1000 and spec.labels[0] == "tench, Tinca tinca"
    assert spec.item_shape == (227, 227, 3) and spec.preprocess.channel_swap == (2, 1, 0)
    assert spec.preprocess.mean == (104.0, 117.0, 123.0)
    assert spec.resize.shorter_side == 256 and spec.resize.crop == "center"
    assert not (spec.folder / "squeezenet_v1.0.caffemodel").is_symlink()


def test_add_links_and_the_linked_model_serves(tmp_path, lenet) -> None:
    repository = tmp_path / "models"
    done = add(repository, "digits", *lenet_files(lenet), "--labels", "0,1,2,3,4,5,6,7,8,9",
               "--scale", "0.00390625", "--link")
    assert done.returncode == 0, done.stderr
    spec = find("digits", [repository])
    assert spec.weights.is_symlink() and spec.weights.resolve() == lenet.weights.resolve()
    assert spec.labels == tuple("0123456789") and spec.preprocess.input_scale == 0.00390625
    assert spec.preprocess.channel_swap == ()  # one channel: nothing to swap
    assert {f.name for f in manifest_of(spec).files} == {"model.toml", "deploy.prototxt",
                                                          "lenet.caffemodel"}


@pytest.mark.parametrize("args, error", [
    (["../up"], "model name '../up' is not allowed"),
    (["digits", "--labels", "a,b,c"], "labels name 3 classes, the output 'prob' has 10 values"),
    (["digits", "--weights-of", "cifar10_quick"], "failed its check: opencv: "),
    (["digits", "--mean", "1,2,3"], "--mean needs 1 value (the net has 1 input channels), got 3"),
])
def test_a_refused_add_leaves_nothing_behind(tmp_path, lenet, args, error) -> None:
    repository = tmp_path / "models"
    files = lenet_files(lenet)
    if "--weights-of" in args:  # another net's weights: every backend refuses them
        files[-1] = str(find(args.pop()).weights)
        args.remove("--weights-of")
    done = add(repository, *args, *files)
    assert done.returncode == 1 and error in done.stderr, done.stderr
    assert not repository.exists()


def test_an_existing_name_needs_force(tmp_path, lenet) -> None:
    repository = tmp_path / "models"
    assert add(repository, "digits", *lenet_files(lenet)).returncode == 0
    again = add(repository, "digits", *lenet_files(lenet), "--description", "new")
    assert again.returncode == 1 and "already exists" in again.stderr and "--force" in again.stderr
    assert find("digits", [repository]).description == "digits"
    forced = add(repository, "digits", *lenet_files(lenet), "--description", "new", "--force")
    assert forced.returncode == 0, forced.stderr
    assert find("digits", [repository]).description == "new"
    assert sorted(p.name for p in repository.iterdir()) == ["digits"]  # no staging left


def test_a_missing_file_is_refused_before_anything_is_written(tmp_path, lenet) -> None:
    done = add(tmp_path / "models", "digits", "--prototxt", str(lenet.prototxt), "--weights",
               str(tmp_path / "nope.caffemodel"))
    assert done.returncode == 2 and "nope.caffemodel' does not exist" in done.stderr
    assert not (tmp_path / "models").exists()


def test_the_user_repository_is_searched_and_written_when_farm_models_is_unset(
        tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FARM_MODELS", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert user_models_dir() == tmp_path / "data" / "farm" / "models"
    assert add_target() == user_models_dir() and add_target(["x"]) == Path("x")
    monkeypatch.setenv("FARM_MODELS", os.pathsep.join(["a", "b"]))
    assert add_target() == Path("a")
    assert search_path(["x"])[:4] == [Path("x"), Path("a"), Path("b"), user_models_dir()]


def test_an_unknown_model_says_how_to_add_one(lenet) -> None:
    with pytest.raises(LookupError) as error:
        find("mynet")
    assert "known: caffenet, cifar10_quick, lenet" in str(error.value)
    assert ("farm models add mynet --prototxt deploy.prototxt --weights mynet.caffemodel"
            in str(error.value))
