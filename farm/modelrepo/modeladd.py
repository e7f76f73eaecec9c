"""``farm models add``: a model folder made from a user's Caffe files, staged until checked.

The files are copied (or linked) into a hidden folder beside the target, with a
``model.toml`` written from the options; the caller checks the staged model and
then ``commit`` moves it into place, or ``discard`` removes every trace of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from farm.modelrepo.caffe_net import InputShapeError, Network, NetworkError
from farm.modelrepo.modelstore import SAFE_NAME
from farm.modelrepo.repository import (
    CROPS,
    ModelError,
    ModelSpec,
    add_target,
    load_spec,
    model_folders,
    origin,
)

#: ``--channel-order``: the order the net was trained in; images arrive RGB.
CHANNEL_ORDERS = ("bgr", "rgb")


@dataclass(frozen=True)
class NewModel:
    """What ``farm models add`` was told about a model."""

    name: str
    prototxt: Path
    weights: Path
    mean_file: Path | None = None
    mean: tuple[float, ...] = ()  # in the net's channel order (B, G, R for a BGR net)
    input_scale: float | None = None  # Caffe's transform_param scale
    raw_scale: float | None = None
    labels_file: Path | None = None
    labels: tuple[str, ...] = ()
    channel_order: str = "bgr"
    resize: tuple[int, ...] = ()  # (N,): the shorter side; (H, W): exactly
    crop: str | None = None
    input_size: tuple[int, int, int] | None = None  # C x H x W, for a prototxt without one
    description: str = ""


@dataclass
class Staged:
    """A model written into a hidden folder beside its final place."""

    model: NewModel
    target: Path  # <repository>/<name>
    folder: Path  # where it is staged
    spec: ModelSpec | None = None  # once model.toml is written and read back
    created: list[Path] = field(default_factory=list)  # folders made for it, innermost first
    sources: dict[str, Path] = field(default_factory=dict)  # file in the folder -> user's file
    shadows: list[Path] = field(default_factory=list)  # folders of this name it will hide

    def user_paths(self, text: str) -> str:
        """``text`` (an error) naming the user's own files, not their staged copies, and no
        staging folder."""
        for name in sorted(self.sources, key=len, reverse=True):  # "a.txt" after "a.txt.gz"
            text = text.replace(str(self.folder / name), str(self.sources[name]))
        text = text.replace(f"{self.folder / 'model.toml'}: ", "")  # written from the options
        return text.replace(str(self.folder), str(self.target))


def check_name(name: str) -> str:
    """A model name usable as a folder name everywhere; ModelError says what is allowed."""
    if not SAFE_NAME.fullmatch(name):
        raise ModelError(
            f"model name {name!r} is not allowed: use letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit (at most 128 characters)"
        )
    return name


def safe_file_name(path: Path) -> str:
    """The name a file gets in the model folder: its own, with odd characters replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)
    return name if name[:1].isalnum() else f"f{name}"


def stage(
    model: NewModel,
    models_dir: Sequence[str | os.PathLike] = (),
    force: bool = False,
    link: bool = False,
) -> Staged:
    """Copy (or symlink) the files into a staging folder in the repository ``add_target``
    picks and write model.toml; ModelError (with nothing left behind, naming the user's files)
    if the name is taken or shadows another model's (both allowed by ``force``), or a file or
    option is unusable."""
    check_name(model.name)
    root = add_target(models_dir)
    target = root / model.name
    if target.exists() and not force:
        raise ModelError(
            f"model folder {target} already exists: choose another name, or replace it with --force"
        )
    shadows = [
        folder
        for folder in model_folders(models_dir).get(model.name, [])
        if folder.resolve() != target.resolve()
    ]
    if shadows and not force:
        raise ModelError(
            f"{model.name!r} would shadow {origin(shadows[0])}: choose another "
            f"name, or shadow it with --force"
        )
    sources = source_files(model)
    folder = root / f".{model.name}.adding-{os.getpid()}"
    staged = Staged(
        model,
        target,
        folder,
        created=missing_folders(root),
        shadows=shadows,
        sources={name: source for name, source in sources.values()},
    )
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for name, source in sources.values():
            place(source, folder / name, link)
        names = {role: name for role, (name, _) in sources.items()}
        (folder / "model.toml").write_text(model_toml(model, names, input_shape(model)))
        staged.spec = load_spec(folder, model.name)
    except (ModelError, OSError) as exc:
        discard(staged)
        raise ModelError(staged.user_paths(str(exc))) from None
    return staged


def missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, innermost first."""
    return [folder for folder in (path, *path.parents) if not folder.exists()]


def source_files(model: NewModel) -> dict[str, tuple[str, Path]]:
    """Role (a model.toml key) -> (name in the folder, the user's file); ModelError for a
    missing or clashing file."""
    files: dict[str, tuple[str, Path]] = {}
    for role, source in (
        ("prototxt", model.prototxt),
        ("weights", model.weights),
        ("mean_file", model.mean_file),
        ("labels", model.labels_file),
    ):
        if source is None:
            continue
        if not source.is_file():
            raise ModelError(f"{source} is not a file")
        name = safe_file_name(source)
        clash = next((path for other, path in files.values() if other == name), None)
        if clash is not None:
            raise ModelError(
                f"{clash} and {source} would both be {name} in the model folder: rename one"
            )
        files[role] = (name, source)
    return files


def place(source: Path, destination: Path, link: bool) -> None:
    """Copy a file, or link to it by its absolute path."""
    if link:
        destination.symlink_to(source.resolve())
    else:
        shutil.copyfile(source, destination)


def input_shape(model: NewModel) -> tuple[int, ...]:
    """The net's input C x H x W, from the prototxt (or ``--input-size``)."""
    try:
        return Network.load(model.prototxt, input_shape=model.input_size).input_shape[1:]
    except InputShapeError as exc:
        raise ModelError(f"{exc}: give it one with --input-size CxHxW") from None
    except NetworkError as exc:
        raise ModelError(str(exc)) from None


def model_toml(model: NewModel, files: dict[str, str], shape: tuple[int, ...]) -> str:
    """A commented model.toml for the model; ``files``: role -> file name in the folder;
    ``shape``: the net's input C x H x W."""
    lines = [
        "# Written by `farm models add`; see docs/models.md for every key.",
        f"description = {toml_string(model.description or model.name)}",
        f"prototxt = {toml_string(files['prototxt'])}",
        f"weights = {toml_string(files['weights'])}",
    ]
    if model.input_size:
        lines += [
            "# the prototxt's input has no shape (or another): C x H x W",
            f"input_shape = {list(model.input_size)}",
        ]
    if "labels" in files:
        lines += [
            "# class names, one per line (a synset_words.txt line: 'n01440764 tench')",
            f"labels = {toml_string(files['labels'])}",
        ]
    elif model.labels:
        lines.append(f"labels = [{', '.join(toml_string(label) for label in model.labels)}]")
    return (
        "\n".join(
            [
                *lines,
                "",
                *preprocess_lines(model, files, shape[0]),
                *resize_lines(model, (shape[1], shape[2])),
            ]
        )
        + "\n"
    )


def preprocess_lines(model: NewModel, files: dict[str, str], channels: int) -> list[str]:
    """``[preprocess]``: Caffe's Transformer settings, in the order they apply."""
    lines = [
        "[preprocess]",
        "# images arrive N x H x W x C, RGB (as decoded image files are)",
        'layout = "HWC"',
    ]
    if model.channel_order == "bgr" and channels == 3:
        lines += [
            "# the net was trained on BGR (Caffe's default): RGB -> BGR",
            "channel_swap = [2, 1, 0]",
        ]
    if model.raw_scale is not None:
        lines += [
            "# multiply the pixels first (Caffe's raw_scale)",
            f"raw_scale = {model.raw_scale!r}",
        ]
    if "mean_file" in files:
        lines += [
            "# subtract this mean image (centre-cropped when larger than the input)",
            f"mean_file = {toml_string(files['mean_file'])}",
        ]
    elif model.mean:
        if len(model.mean) not in (1, channels):
            wanted = "1 value" if channels == 1 else f"1 or {channels} values"
            raise ModelError(
                f"--mean needs {wanted} (the net has {channels} input "
                f"channels), got {len(model.mean)}"
            )
        lines += [
            "# subtract per channel, in the net's channel order (Caffe's mean_value)",
            f"mean = {[float(v) for v in model.mean]}",
        ]
    if model.input_scale is not None:
        lines += [
            "# multiply after the mean (Caffe's transform_param scale)",
            f"input_scale = {model.input_scale!r}",
        ]
    return lines


def resize_lines(model: NewModel, net_size: tuple[int, int]) -> list[str]:
    """``[resize]``: how image files are brought to the net's input size (H, W), if asked."""
    if not model.resize and model.crop is None:
        return []
    if model.crop == "none" and model.resize not in ((), net_size):
        raise ModelError(
            f"--crop none resizes straight to the net's input size, "
            f"{net_size[0]}x{net_size[1]}: drop --resize, or choose another --crop"
        )
    lines = ["", "[resize]"]
    if len(model.resize) == 1:
        lines += [
            "# resize so the shorter side has this length, keeping the aspect ratio",
            f"shorter_side = {model.resize[0]}",
        ]
    elif len(model.resize) == 2:
        lines += ["# resize to exactly this height and width", f"size = {list(model.resize)}"]
    if model.crop is not None:
        if model.crop not in CROPS:
            raise ModelError(f"--crop must be one of {', '.join(CROPS)}")
        lines += [
            "# then take the net's input size: center, oversample (10 crops) or none",
            f"crop = {toml_string(model.crop)}",
        ]
    return lines


def toml_string(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(text, ensure_ascii=False)


def commit(staged: Staged) -> ModelSpec:
    """Move the checked model into place (replacing an old one); its spec there."""
    staged.created.clear()
    old = staged.target.with_name(f".{staged.target.name}.old-{os.getpid()}")
    if staged.target.exists():
        staged.target.rename(old)
    staged.folder.rename(staged.target)
    shutil.rmtree(old, ignore_errors=True)
    return load_spec(staged.target)


def discard(staged: Staged) -> None:
    """Remove everything ``stage`` wrote."""
    shutil.rmtree(staged.folder, ignore_errors=True)
    for folder in staged.created:
        try:
            folder.rmdir()  # only if still empty
        except OSError:
            break
