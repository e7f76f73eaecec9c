"""``farm models add``: a user's Caffe files become a checked model, or nothing at all."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from farm.modelrepo.modelstore import manifest_of
from farm.modelrepo.repository import add_target, find, search_path, shown, user_models_dir
from farm.ops.local import farm_command

#: The real SqueezeNet v1.0 (ImageNet), read from the shared folder beside the repository.
SQUEEZENET = Path(__file__).resolve().parents[2] / ".." / "shared" / "models" / "squeezenet_v1.0"


def add(repository: Path, *args: str) -> subprocess.CompletedProcess:
    """``farm models add ARGS`` with ``repository`` as $FARM_MODELS."""
    return subprocess.run(
        farm_command("models", "add", *args, "--count", "2"),
        env={**os.environ, "FARM_MODELS": str(repository)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def lenet_files(lenet) -> list[str]:
    return ["--prototxt", str(lenet.prototxt), "--weights", str(lenet.weights)]


@pytest.mark.skipif(
    not (SQUEEZENET / "squeezenet_v1.0.caffemodel").is_file(),
    reason=f"the shared SqueezeNet is not at {SQUEEZENET}",
)
def test_add_squeezenet_with_its_labels(tmp_path) -> None:
    repository = tmp_path / "models"
    done = add(
        repository,
        "squeezenet",
        "--prototxt",
        str(SQUEEZENET / "deploy.prototxt"),
        "--weights",
        str(SQUEEZENET / "squeezenet_v1.0.caffemodel"),
        "--mean",
        "104,117,123",
        "--labels",
        str(SQUEEZENET / "synset_words.txt"),
        "--resize",
        "256",
        "--crop",
        "center",
    )
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
    done = add(
        repository,
        "digits",
        *lenet_files(lenet),
        "--labels",
        "0,1,2,3,4,5,6,7,8,9",
        "--scale",
        "0.00390625",
        "--link",
    )
    assert done.returncode == 0, done.stderr
    spec = find("digits", [repository])
    assert spec.weights.is_symlink() and spec.weights.resolve() == lenet.weights.resolve()
    assert spec.labels == tuple("0123456789") and spec.preprocess.input_scale == 0.00390625
    assert spec.preprocess.channel_swap == ()  # one channel: nothing to swap
    assert {f.name for f in manifest_of(spec).files} == {
        "model.toml",
        "deploy.prototxt",
        "lenet.caffemodel",
    }


@pytest.mark.parametrize(
    "args, error",
    [
        (["../up"], "model name '../up' is not allowed"),
        (["digits", "--labels", "a,b,c"], "labels name 3 classes, the output 'prob' has 10 values"),
        (["digits", "--weights-of", "cifar10_quick"], "failed its check: opencv: "),
        (
            ["digits", "--mean", "1,2,3"],
            "--mean needs 1 value (the net has 1 input channels), got 3",
        ),
    ],
)
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


def farm(repository: Path, *args: str) -> subprocess.CompletedProcess:
    """``farm ARGS`` with ``repository`` as $FARM_MODELS."""
    return subprocess.run(
        farm_command(*args),
        env={**os.environ, "FARM_MODELS": str(repository)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def users_copy(lenet, folder: Path) -> list[str]:
    """The bundled LeNet's prototxt and weights copied to ``folder``, as a user's own files."""
    folder.mkdir(exist_ok=True)
    for path in (lenet.prototxt, lenet.weights):
        shutil.copyfile(path, folder / path.name)
    return [
        "--prototxt",
        str(folder / lenet.prototxt.name),
        "--weights",
        str(folder / lenet.weights.name),
    ]


def test_a_bundled_name_needs_force_and_the_bundled_model_stays_listed(tmp_path, lenet) -> None:
    repository = tmp_path / "models"
    files = users_copy(lenet, tmp_path / "mine")
    refused = add(repository, "lenet", *files)
    assert refused.returncode == 1 and not repository.exists()
    assert refused.stderr.strip() == (
        f"Error: not added: 'lenet' would shadow the bundled model lenet ({shown(lenet.folder)}): "
        f"choose another name, or shadow it with --force"
    )
    forced = add(repository, "lenet", *files, "--force")
    assert forced.returncode == 0, forced.stderr
    assert f"it shadows the bundled model lenet ({shown(lenet.folder)})" in forced.stdout
    assert find("lenet", [repository]).folder == repository / "lenet"
    listed = [
        line
        for line in farm(repository, "models", "list").stdout.splitlines()
        if line.startswith("lenet ")
    ]
    assert len(listed) == 2 and "shadowed" not in listed[0]
    assert f"(bundled, shadowed by {shown(repository / 'lenet')}) LeNet trained" in listed[1]
    sampled = farm(repository, "run")  # no IMAGES: the model's sample, which this one lacks
    assert sampled.returncode == 1 and sampled.stderr.strip() == (
        f"Error: model 'lenet' ({shown(repository / 'lenet')}) has no sample; it shadows the "
        f"bundled model lenet ({shown(lenet.folder)}), which has one; give IMAGES"
    )


def test_a_folder_placed_by_hand_over_a_bundled_name_is_listed_as_shadowing(tmp_path) -> None:
    bundled = find("cifar10_quick")
    placed = Path(shutil.copytree(bundled.folder, tmp_path / "models" / "cifar10_quick"))
    listing = farm(tmp_path / "models", "models", "list").stdout
    assert f"(bundled, shadowed by {shown(placed)}) {bundled.description}" in listing
    shown_model = farm(tmp_path / "models", "models", "show", "cifar10_quick").stdout
    assert f"  folder      {placed}" in shown_model
    assert f"  shadows     the bundled model cifar10_quick ({shown(bundled.folder)})" in shown_model


def write_bad_input(lenet, folder: Path, kind: str) -> tuple[list[str], Path]:
    """The user's files for ``farm models add`` with one bad input of ``kind``; the options
    and the bad file."""
    files = users_copy(lenet, folder)
    prototxt, weights = Path(files[1]), Path(files[3])
    if kind == "unparsable prototxt":
        prototxt.write_text("layer { name: 'conv1' type: \n")
        return files, prototxt
    if kind == "prototxt without an input shape":
        text = prototxt.read_text()
        start = text.index("layer {", text.index('type: "Input"'))
        prototxt.write_text('input: "data"\n' + text[start:])
        return files, prototxt
    if kind == "weights of another net":
        shutil.copyfile(find("cifar10_quick").weights, weights)
        return files, weights
    if kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
        return files, weights
    if kind == "too few labels":
        labels = folder / "labels.txt"
        labels.write_text("zero\none\ntwo\n")
        return [*files, "--labels", str(labels)], labels
    assert kind == "unreadable mean file"
    mean = folder / "mean.binaryproto"
    mean.write_bytes(b"not a blob")
    return [*files, "--mean-file", str(mean)], mean


@pytest.mark.parametrize(
    "kind, error",
    [
        ("unparsable prototxt", "{path} is not a valid prototxt: "),
        (
            "prototxt without an input shape",
            "{path}: input 'data' has no shape: give it one with --input-size CxHxW",
        ),
        (
            "weights of another net",
            "weights file {path} does not match the prototxt: layer 'conv1' "
            "blob 0 has shape (32, 3, 5, 5)",
        ),
        ("truncated weights", "{path} is not a Caffe NetParameter"),
        ("too few labels", "labels file {path} names 3 classes, the output 'prob' has 10 values"),
        ("unreadable mean file", "cannot read blob file {path}: "),
    ],
)
def test_a_bad_input_is_named_as_the_user_gave_it(tmp_path, lenet, kind, error) -> None:
    """One line naming the user's file, never the staging folder; the --input-size hint only
    for an input without a shape."""
    repository = tmp_path / "models"
    files, bad = write_bad_input(lenet, tmp_path / "mine", kind)
    done = add(repository, "digits", *files)
    assert done.returncode == 1 and not repository.exists(), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert error.format(path=bad) in done.stderr, done.stderr
    assert ".adding" not in done.stdout + done.stderr
    assert ("--input-size" in done.stderr) == (kind == "prototxt without an input shape")


def test_crop_none_with_another_size_is_refused_in_the_options_terms(tmp_path, lenet) -> None:
    done = add(
        tmp_path / "models",
        "digits",
        *users_copy(lenet, tmp_path / "mine"),
        "--resize",
        "40",
        "--crop",
        "none",
    )
    assert done.returncode == 1 and done.stderr.strip() == (
        "Error: not added: --crop none resizes straight to the net's input size, 28x28: drop "
        "--resize, or choose another --crop"
    )


def test_a_missing_file_is_refused_before_anything_is_written(tmp_path, lenet) -> None:
    done = add(
        tmp_path / "models",
        "digits",
        "--prototxt",
        str(lenet.prototxt),
        "--weights",
        str(tmp_path / "nope.caffemodel"),
    )
    assert done.returncode == 2 and "nope.caffemodel' does not exist" in done.stderr
    assert not (tmp_path / "models").exists()


def test_the_user_repository_is_searched_and_written_when_farm_models_is_unset(
    tmp_path, monkeypatch
) -> None:
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
    assert "farm models add mynet --prototxt deploy.prototxt --weights mynet.caffemodel" in str(
        error.value
    )
