"""The model repository: one folder per model with its Caffe files and a ``model.toml``.

``model.toml`` says what the prototxt does not: where the weights are, how
images are turned into the net's input (Caffe's ``Transformer``), the class
labels, and an optional sample.  The input blob and its shape come from the
prototxt itself.  A model whose weights are too large to ship names a seed under
``[generate]``: its weights are made from the prototxt's fillers on first use
and cached (``farm models prepare NAME``), with their digest recorded beside them: weights
that no longer match it are made again (``farm.modelrepo.sealed``).
"""

from __future__ import annotations

import logging
import math
import os
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.modelrepo import sealed
from farm.modelrepo.caffe_net import InputShapeError, Network, NetworkError

log = logging.getLogger("farm.modelrepo.repository")

#: Models bundled with the package.
BUNDLED_DIR = Path(__file__).parent.parent / "models"  # farm/models/

LAYOUTS = ("CHW", "HWC")
#: ``[resize] crop``: one centre crop, Caffe ``classify.py``'s 10 crops, or none.
CROPS = ("center", "oversample", "none")
#: ``[resize] interpolation``: OpenCV's resize filters by name.
INTERPOLATIONS = ("linear", "area", "cubic", "nearest")


class ModelError(LookupError):
    """A model is unknown or its files are broken."""


def cache_root() -> Path:
    """Where fetched models and generated weights are kept: ``$FARM_CACHE`` or ``~/.cache/farm``."""
    return Path(os.environ.get("FARM_CACHE") or Path.home() / ".cache" / "farm")


@dataclass(frozen=True)
class Preprocess:
    """Caffe ``Transformer`` settings, applied in this order to each image.

    layout (HWC images are transposed to CHW), channel_swap (a permutation of
    the channels, e.g. RGB -> BGR), raw_scale (multiply), mean (subtract: one
    value per channel, or a whole C x H x W mean file), input_scale (multiply).
    """

    layout: str = "CHW"
    channel_swap: tuple[int, ...] = ()
    raw_scale: float = 1.0
    mean: tuple[float, ...] = ()
    mean_file: Path | None = None
    input_scale: float = 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any], folder: Path) -> Preprocess:
        unknown = set(config) - {
            "layout",
            "channel_swap",
            "raw_scale",
            "mean",
            "mean_file",
            "input_scale",
        }
        if unknown:
            raise ModelError(f"[preprocess] has unknown keys {sorted(unknown)}")
        layout = config.get("layout", "CHW")
        if layout not in LAYOUTS:
            raise ModelError(f"[preprocess] layout must be one of {LAYOUTS}, got {layout!r}")
        if "mean" in config and "mean_file" in config:
            raise ModelError("[preprocess] takes mean or mean_file, not both")
        return cls(
            layout,
            tuple(config.get("channel_swap", ())),
            float(config.get("raw_scale", 1.0)),
            tuple(config.get("mean", ())),
            inside(folder, config["mean_file"]) if "mean_file" in config else None,
            float(config.get("input_scale", 1.0)),
        )


@dataclass(frozen=True)
class Resize:
    """How a worker turns a decoded image file into the net's input size (``[resize]``).

    ``size`` (H, W): resize to exactly this; else ``shorter_side``: resize keeping the
    aspect ratio so the shorter side has this length; else resize to the crop itself.
    Then ``crop``: ``center`` (the net's H x W from the middle, as Caffe's data layer
    and ``classify.py --center_only``), ``oversample`` (10 crops: 4 corners and the
    centre, each also mirrored, as ``classify.py``; the outputs are averaged) or
    ``none`` (the image is resized straight to the net's input size).
    """

    size: tuple[int, int] | None = None
    shorter_side: int | None = None
    crop: str = "center"
    interpolation: str = "linear"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Resize:
        unknown = set(config) - {"size", "shorter_side", "crop", "interpolation"}
        if unknown:
            raise ModelError(f"[resize] has unknown keys {sorted(unknown)}")
        if "size" in config and "shorter_side" in config:
            raise ModelError("[resize] takes size or shorter_side, not both")
        size = config.get("size")
        if size is not None:
            if (
                not isinstance(size, list)
                or len(size) != 2
                or not all(isinstance(n, int) and n > 0 for n in size)
            ):
                raise ModelError(f"[resize] size must be [height, width], got {size!r}")
            size = (size[0], size[1])
        shorter = config.get("shorter_side")
        if shorter is not None and not (isinstance(shorter, int) and shorter > 0):
            raise ModelError(f"[resize] shorter_side must be a positive integer, got {shorter!r}")
        crop = config.get("crop", "center")
        if crop not in CROPS:
            raise ModelError(f"[resize] crop must be one of {CROPS}, got {crop!r}")
        interpolation = config.get("interpolation", "linear")
        if interpolation not in INTERPOLATIONS:
            raise ModelError(
                f"[resize] interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}"
            )
        return cls(size, shorter, crop, interpolation)

    @property
    def crops(self) -> int:
        """Inputs per image: 10 when oversampling, else 1."""
        return 10 if self.crop == "oversample" else 1

    def check(self, net_size: tuple[int, int]) -> None:
        """``crop = "none"`` resizes straight to the net's H x W: a size or shorter side
        that says otherwise would be silently ignored, so it is refused (ModelError)."""
        if self.crop == "none" and (
            self.shorter_side is not None or self.size not in (None, net_size)
        ):
            raise ModelError(
                f'[resize] crop = "none" resizes straight to the input\'s '
                f"{net_size[0]} x {net_size[1]}; drop size/shorter_side or choose "
                f"a crop"
            )


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to load and feed a model."""

    name: str
    folder: Path
    prototxt: Path
    weights: Path
    input: str
    input_shape: tuple[int, ...]  # C x H x W: the net's input without the batch axis
    batch: int  # the prototxt's batch size: the net's resting shape
    output: str
    preprocess: Preprocess = field(default_factory=Preprocess)
    resize: Resize = field(default_factory=Resize)
    description: str = ""
    labels: tuple[str, ...] = ()
    labels_file: Path | None = None  # where ``labels`` came from, if from a file
    softmax: bool = False  # the output blob is a Softmax layer's: probabilities already
    sample: Path | None = None
    sample_labels: Path | None = None
    generate_seed: int | None = None  # weights made from the prototxt's fillers with this seed
    weights_name: str = ""  # the weights' path relative to the folder (also when generated)
    declared_input: tuple[int, int, int] | None = None  # model.toml's input_shape: C x H x W

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one image as clients send it (H x W x C for an HWC layout)."""
        if self.preprocess.layout == "HWC":
            return (*self.input_shape[1:], self.input_shape[0])
        return self.input_shape

    @property
    def input_scale(self) -> float:
        return self.preprocess.input_scale

    def files(self) -> dict[str, Path]:
        """The files a worker needs, by their path relative to the model folder."""

        def relative(path: Path) -> str:
            return path.relative_to(self.folder).as_posix()

        files = {
            "model.toml": self.folder / "model.toml",
            relative(self.prototxt): self.prototxt,
            self.weights_name or self.weights.name: self.weights,
        }
        if self.preprocess.mean_file:
            files[relative(self.preprocess.mean_file)] = self.preprocess.mean_file
        if self.labels_file:
            files[relative(self.labels_file)] = self.labels_file
        return files


def user_models_dir() -> Path:
    """The user's own repository: ``$XDG_DATA_HOME/farm/models`` or
    ``~/.local/share/farm/models``."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "farm" / "models"


def env_models_dirs() -> list[Path]:
    """The folders of ``$FARM_MODELS`` (an ``os.pathsep`` list)."""
    return [Path(p) for p in os.environ.get("FARM_MODELS", "").split(os.pathsep) if p]


def search_path(extra: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Model folders to search: explicit ones, then ``$FARM_MODELS``, then the user's
    repository (``user_models_dir``), then the bundled ones."""
    return [*map(Path, extra), *env_models_dirs(), user_models_dir(), BUNDLED_DIR]


def missing_env_models_dirs() -> list[str]:
    """A warning for each ``$FARM_MODELS`` entry that is not a folder (a typo, an
    unmounted share): no model is found there, and nothing else would say so."""
    return [
        f"$FARM_MODELS names {folder}, which is not a folder: no models are found there "
        "(`farm models add` creates it)"
        for folder in env_models_dirs()
        if not folder.is_dir()
    ]


def add_target(extra: Sequence[str | os.PathLike] = ()) -> Path:
    """Where ``farm models add`` writes: the first ``--models-dir``, else the first
    ``$FARM_MODELS`` folder, else the user's repository."""
    return next(iter([*map(Path, extra), *env_models_dirs()]), user_models_dir())


def generated_weights_path(name: str, filename: str) -> Path:
    return cache_root() / "generated" / name / filename


def load_spec(folder: Path, name: str | None = None) -> ModelSpec:
    """Read ``folder/model.toml`` and the prototxt; ModelError names the file and the problem.

    The model's name is the folder's, unless ``name`` is given (a cached copy's folder
    also carries its digest).
    """
    config_path = folder / "model.toml"
    try:
        config = tomllib.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ModelError(f"cannot read {config_path}: {exc}") from exc
    try:
        spec = _spec_from_config(folder, config, name or folder.name)
    except KeyError as exc:
        raise ModelError(f"{config_path} lacks the key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{config_path}: {exc}") from None
    except ModelError as exc:
        raise ModelError(f"{config_path}: {exc}") from None
    missing = [
        path for path in spec.files().values() if not path.is_file() and path != spec.weights
    ]
    if missing:
        raise ModelError(f"model {spec.name!r}: file {missing[0]} is missing")
    if not spec.weights.is_file() and spec.generate_seed is None:
        raise ModelError(f"model {spec.name!r}: file {spec.weights} is missing")
    return spec


def inside(folder: Path, relative: str) -> Path:
    """``folder / relative``, refusing absolute paths and paths that leave the folder.

    The check is on the name, not on where a symbolic link in the folder points: the
    folder's owner may link files in (``farm models add --link``).
    """
    if Path(relative).is_absolute() or os.path.normpath(relative).split(os.sep)[0] == "..":
        raise ModelError(f"{relative!r} is outside the model folder")
    return folder / relative


def _spec_from_config(folder: Path, config: dict[str, Any], name: str) -> ModelSpec:
    prototxt = inside(folder, config["prototxt"])
    declared = declared_input(config.get("input_shape"))
    try:
        net = Network.load(prototxt, input_shape=declared)
    except InputShapeError as exc:
        raise ModelError(f"{exc} (model.toml's input_shape = [C, H, W] gives it one)") from None
    except NetworkError as exc:
        raise ModelError(str(exc)) from None
    generate = config.get("generate")
    weights = inside(folder, config["weights"])
    if generate is not None and not weights.is_file():
        weights = generated_weights_path(name, config["weights"])
    if config.get("input", net.input) != net.input:
        raise ModelError(f"input {config['input']!r} is not the prototxt's input {net.input!r}")
    output = config.get("output", net.output)
    if output not in net.shapes:
        raise ModelError(f"output {output!r} is not a blob of {prototxt}")
    labels, labels_file = read_labels(folder, config.get("labels", []))
    resize = Resize.from_config(config.get("resize", {}))
    resize.check((net.input_shape[-2], net.input_shape[-1]))
    classes = math.prod(net.shapes[output][1:])
    if labels and len(labels) != classes:
        named = f"labels file {labels_file} names" if labels_file else "labels name"
        raise ModelError(
            f"{named} {len(labels)} classes, the output {output!r} has {classes} values"
        )
    writer = (
        next(layer for layer in reversed(net.layers) if output in layer.tops)
        if output != net.input
        else None
    )
    return ModelSpec(
        name=name,
        folder=folder,
        prototxt=prototxt,
        weights=weights,
        input=net.input,
        input_shape=net.input_shape[1:],
        batch=net.batch,
        output=output,
        preprocess=Preprocess.from_config(config.get("preprocess", {}), folder),
        resize=resize,
        weights_name=Path(config["weights"]).as_posix(),
        description=config.get("description", ""),
        labels=labels,
        labels_file=labels_file,
        softmax=writer is not None and writer.type == "Softmax",
        sample=inside(folder, config["sample"]) if "sample" in config else None,
        sample_labels=(
            inside(folder, config["sample_labels"]) if "sample_labels" in config else None
        ),
        generate_seed=int(generate["seed"]) if generate is not None else None,
        declared_input=declared,
    )


def declared_input(shape: Any) -> tuple[int, int, int] | None:
    """model.toml's ``input_shape = [C, H, W]``, for a prototxt whose input has no shape."""
    if shape is None:
        return None
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(n, int) and n > 0 for n in shape)
    ):
        raise ModelError(f"input_shape must be [channels, height, width], got {shape!r}")
    return shape[0], shape[1], shape[2]


def read_labels(folder: Path, labels: Any) -> tuple[tuple[str, ...], Path | None]:
    """``labels`` of model.toml: a list of names, or a file of one name per line (such as
    Caffe's ``synset_words.txt``, whose lines are ``n01440764 tench, Tinca tinca``: the
    WordNet id is dropped).  Returns the names and the file they came from."""
    if isinstance(labels, list):
        return tuple(str(label) for label in labels), None
    if not isinstance(labels, str):
        raise ModelError(f"labels must be a list of names or a file name, got {labels!r}")
    path = inside(folder, labels)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"cannot read labels file {path}: {exc}") from exc
    return tuple(label_name(line) for line in lines if line.strip()), path


def label_name(line: str) -> str:
    """A class name from a labels file line: ``n01440764 tench, Tinca tinca`` -> ``tench,
    Tinca tinca``; any other line as it is."""
    line = line.strip()
    wnid, _, rest = line.partition(" ")
    if rest and len(wnid) == 9 and wnid[0] == "n" and wnid[1:].isdigit():
        return rest.strip()
    return line


def available(extra: Sequence[str | os.PathLike] = ()) -> dict[str, Path]:
    """Model name -> folder, the first folder on the search path winning."""
    return {name: folders[0] for name, folders in model_folders(extra).items()}


def model_folders(extra: Sequence[str | os.PathLike] = ()) -> dict[str, list[Path]]:
    """Model name -> every folder on the search path that holds it: the one farm uses, then
    the ones it shadows."""
    found: dict[str, list[Path]] = {}
    roots: set[Path] = set()
    for root in search_path(extra):
        if not root.is_dir() or root.resolve() in roots:
            continue
        roots.add(root.resolve())
        for folder in sorted(root.iterdir()):
            # hidden folders are not models (``farm models add`` stages one there)
            if not folder.name.startswith(".") and (folder / "model.toml").is_file():
                found.setdefault(folder.name, []).append(folder)
    return found


def shown(path: Path) -> str:
    """A path for people: one under the home folder as ``~/...``."""
    try:
        return f"~/{path.relative_to(Path.home()).as_posix()}"
    except ValueError:
        return str(path)


def is_bundled(folder: Path) -> bool:
    """Whether a model folder is one of the models bundled with farm."""
    return folder.parent.resolve() == BUNDLED_DIR.resolve()


def origin(folder: Path) -> str:
    """Where a model folder is, for people: ``the bundled model NAME (PATH)`` or
    ``the model in PATH``."""
    if is_bundled(folder):
        return f"the bundled model {folder.name} ({shown(folder)})"
    return f"the model in {shown(folder)}"


def find(name: str, extra: Sequence[str | os.PathLike] = ()) -> ModelSpec:
    """The spec of a model by name; raise ModelError naming the known ones."""
    spec = find_local(name, extra)
    if spec is None:
        raise ModelError(unknown_model(name, available(extra)))
    return spec


def find_local(name: str, extra: Sequence[str | os.PathLike] = ()) -> ModelSpec | None:
    """The model NAME from this host's repositories, or None when none holds it; ModelError
    when its folder is broken."""
    folder = available(extra).get(name)
    return None if folder is None else load_spec(folder)


def unknown_model(name: str, known: Iterable[str]) -> str:
    """The error for a model nobody has: the known ones, and how to add one."""
    return (
        f"unknown model {name!r}; known: {', '.join(sorted(known)) or 'none'}. Add it with "
        f"`farm models add {name} --prototxt deploy.prototxt --weights {name}.caffemodel`, "
        f"or point --models-dir or $FARM_MODELS at a folder holding {name}/model.toml"
    )


def generated(spec: ModelSpec) -> bool:
    """Whether the model's weights are made from its fillers and kept in farm's cache
    (not shipped in its folder)."""
    return spec.generate_seed is not None and not spec.weights.is_relative_to(spec.folder)


def generated_format(spec: ModelSpec) -> str:
    """The format a generated weights file's record names: the seed is part of it."""
    return f"farm generated caffemodel seed {spec.generate_seed}"


def prepare(spec: ModelSpec) -> Path:
    """Make sure the weights file exists: generate and cache it when the model says how.
    Cached generated weights are used only when they match the digest recorded when they
    were made; others are logged, removed and made again."""
    if generated(spec):
        if sealed.verified(spec.weights, "generated weights", generated_format(spec)):
            return spec.weights
    elif spec.weights.is_file():
        return spec.weights
    if spec.generate_seed is None:
        raise ModelError(f"model {spec.name!r}: file {spec.weights} is missing")
    from farm.modelrepo.caffe_net import generated_weights
    from farm.modelrepo.caffe_proto import write_caffemodel

    log.info(
        "generating weights for %s (seed %d) into %s", spec.name, spec.generate_seed, spec.weights
    )
    try:
        net = Network.load(spec.prototxt, input_shape=spec.declared_input)
        layers = generated_weights(net, spec.generate_seed)
        spec.weights.parent.mkdir(parents=True, exist_ok=True)
        # atomic, its digest recorded first: a concurrent reader never sees half a file
        sealed.write(
            spec.weights,
            lambda partial: write_caffemodel(partial, net.name, layers),
            generated_format(spec),
        )
    except (NetworkError, OSError) as exc:
        raise ModelError(f"model {spec.name!r}: cannot generate {spec.weights}: {exc}") from exc
    return spec.weights
