"""``farm models``: inspect, check, export and prepare the models of the repository."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from farm import defaults
from farm.cli.options import models_dir_option, precision_option

if TYPE_CHECKING:
    from farm.engines.modelcheck import BackendCheck
    from farm.modelrepo.caffe_net import Network
    from farm.modelrepo.modeladd import NewModel
    from farm.modelrepo.repository import ModelSpec

#: ``--channel-order`` and ``--crop`` of ``farm models add``
#: (farm.modelrepo.modeladd.CHANNEL_ORDERS and farm.modelrepo.repository.CROPS, kept here
#: so the CLI starts without importing them).
CHANNEL_ORDER_CHOICES = ("bgr", "rgb")
CROP_CHOICES = ("center", "oversample", "none")

#: ``--models-dir`` of every ``farm models`` command.
extra_models_option = models_dir_option(
    "Extra model repository folder (repeatable; also $FARM_MODELS)."
)


@click.group()
def models() -> None:
    """Inspect, check and prepare the model repository.

    \b
    Examples:
      farm models list
      farm models show caffenet
      farm models check lenet
      farm models export lenet --onnx lenet.onnx
      farm models prepare caffenet
      farm models quantize squeezenet --calibration photos/
      farm models add mynet --prototxt deploy.prototxt --weights mynet.caffemodel
    """


def find_model(name: str, models_dir: tuple[str, ...]) -> ModelSpec:
    """The model NAME, or a one-line error."""
    from farm.modelrepo.repository import ModelError, find

    try:
        return find(name, models_dir)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from exc


def shape_text(shape: tuple[int, ...]) -> str:
    """``(1, 28, 28)`` -> ``1x28x28``."""
    return "x".join(map(str, shape))


@models.command("list")
@extra_models_option
def list_models(models_dir: tuple[str, ...]) -> None:
    """List the models in the repository.

    A model that another folder of the same name shadows (one earlier on the search
    path: --models-dir, $FARM_MODELS, the user's repository, the bundled models) is
    listed after it, marked as shadowed.

    \b
    Examples:
      farm models list
      farm models list --models-dir ~/models     # or FARM_MODELS=~/models
    """
    from farm.modelrepo.repository import is_bundled, model_folders, shown

    click.echo(f"{'model':<16} {'images':<12} {'layout':<6} {'weights':<22} description")
    for name, folders in model_folders(models_dir).items():
        click.echo(model_row(name, folders[0]))
        for hidden in folders[1:]:
            where = "bundled" if is_bundled(hidden) else f"in {shown(hidden.parent)}"
            click.echo(model_row(name, hidden, f"({where}, shadowed by {shown(folders[0])}) "))


def model_row(name: str, folder: Path, note: str = "") -> str:
    """One line of ``farm models list``, ``note`` before the description."""
    from farm.modelrepo.repository import ModelError, load_spec

    try:
        spec = load_spec(folder)
    except ModelError as exc:
        return f"{name:<16} {note}BROKEN: {exc}"
    weights = (
        f"{spec.weights.stat().st_size / 1e6:.1f} MB"
        if spec.weights.is_file()
        else "made on first use"
    )
    return (
        f"{name:<16} {shape_text(spec.item_shape):<12} {spec.preprocess.layout:<6} "
        f"{weights:<22} {note}{spec.description}"
    )


@models.command("show")
@click.argument("name")
@extra_models_option
def show_model(name: str, models_dir: tuple[str, ...]) -> None:
    """Show a model's files, input, preprocessing and layers.

    \b
    Example:
      farm models show lenet
    """
    from farm.modelrepo.caffe_net import Network
    from farm.modelrepo.repository import model_folders, origin

    spec = find_model(name, models_dir)
    net = Network.load(spec.prototxt, input_shape=spec.declared_input)
    shadows = [
        f"  shadows     {origin(hidden)}" for hidden in model_folders(models_dir).get(name, [])[1:]
    ]
    click.echo("\n".join([*model_lines(spec, net), *shadows, *layer_lines(net)]))


def model_lines(spec: ModelSpec, net: Network) -> list[str]:
    """``farm models show``'s head: files, input, preprocessing, output."""
    from farm.modelrepo.caffe_proto import unknown_fields

    p = spec.preprocess
    weights = (
        f"{spec.weights} ({spec.weights.stat().st_size / 1e6:.1f} MB)"
        if spec.weights.is_file()
        else f"{spec.weights} (not made yet: farm models prepare {spec.name})"
    )
    mean = (
        f"file {p.mean_file.name}"
        if p.mean_file
        else ", ".join(map(str, p.mean))
        if p.mean
        else "none"
    )
    lines = [
        f"{spec.name}: {spec.description}",
        f"  folder      {spec.folder}",
        f"  prototxt    {spec.prototxt.name}",
        f"  weights     {weights}",
        f"  input       {spec.input} {shape_text(net.input_shape)} (batch {spec.batch}); "
        f"images {shape_text(spec.item_shape)} ({p.layout})",
        f"  preprocess  channel_swap {list(p.channel_swap) or 'none'}, raw_scale "
        f"{p.raw_scale:g}, mean {mean}, input_scale {p.input_scale:g}",
        f"  output      {spec.output} {shape_text(net.shapes[spec.output][1:])}"
        f"{f', {len(spec.labels)} labels' if spec.labels else ''}",
        f"  parameters  {net.parameter_count():,}",
    ]
    ignored = unknown_fields(spec.prototxt.read_text())
    if ignored:
        lines.append(f"  ignored     {', '.join(ignored)} (fields farm's Caffe schema lacks)")
    return lines


def layer_lines(net: Network) -> list[str]:
    """``farm models show``'s table of layers: type, output shape, weight shapes."""
    lines = [f"  {'layer':<14} {'type':<13} {'output':<16} weights"]
    for layer in net.layers:
        blobs = ", ".join(shape_text(shape) for shape in layer.blob_shapes)
        lines.append(
            f"  {layer.name:<14} {layer.type:<13} "
            f"{shape_text(net.shapes[layer.tops[0]][1:]):<16} {blobs}"
        )
    return lines


@models.command("check")
@click.argument("name")
@click.option(
    "--count",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Images to compare (the model's sample, else seeded random images).",
)
@precision_option(
    "Compare this precision with the reference in f32 (top-1 agreement too); auto: run "
    "the precision gate on --validate (default: the model's sample).",
    defaults.PRECISION,
    gated=True,
)
@click.option(
    "--threads",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Compute threads, for the speeds and auto's choice (1: a pinned worker).",
)
@extra_models_option
def check_model_command(
    name: str,
    count: int,
    precision: str,
    min_agreement: float,
    validate: tuple[str, ...],
    threads: int,
    models_dir: tuple[str, ...],
) -> None:
    """Load NAME on every backend here, compare their outputs, and show auto's choice.

    Differences are relative to the largest output of the reference (the first
    backend that runs the model, in f32).  The model's int8 version and the precision
    gate's remembered verdicts follow, if there are any.

    \b
    Examples:
      farm models check lenet
      farm models check caffenet --count 2
      farm models check cifar10_quick --precision bf16
      farm models check squeezenet --precision auto --validate photos/
    """
    from farm.engines.autoselect import choose
    from farm.modelrepo.repository import ModelError

    spec = find_model(name, models_dir)
    if precision == "auto":
        run_gate(spec, validate, min_agreement / 100, threads)
        return
    problem = run_check(spec, count, precision, threads)
    for line in precision_lines(spec):
        click.echo(line)
    try:
        choice = choose(spec, "cpu", threads, precision)
        click.echo(f"auto on {threads} thread(s): {choice.describe()}")
    except ModelError as exc:
        click.echo(f"auto: {exc}")
    if problem:
        raise click.ClickException(problem)


def run_gate(
    spec: ModelSpec, validate: tuple[str, ...], min_agreement: float, threads: int
) -> None:
    """``farm models check --precision auto``: the gate on ``validate`` (else the model's
    sample, scored against its labels when it has them)."""
    import numpy as np

    from farm.client.inputs import InputError
    from farm.client.samples import sample_of
    from farm.engines.gate import judge
    from farm.modelrepo.repository import ModelError

    count = defaults.VALIDATION_IMAGES
    labels = None
    if not validate:
        if spec.sample is None:
            raise click.ClickException(
                f"model {spec.name!r} has no sample: name validation images with --validate"
            )
        validate = (str(spec.sample),)
        if spec.sample_labels is not None:
            labels = np.load(spec.sample_labels)[:count]
    try:
        sample = sample_of(validate, spec, count)
        labels = None if labels is None else labels[sample.kept]
        gate = judge(spec, sample.images, labels, min_agreement, threads)
    except (InputError, ModelError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{spec.name}: validation: {sample.describe()}, {threads} thread(s)")
    for line in gate.lines():
        click.echo(line)


def precision_lines(spec: ModelSpec) -> list[str]:
    """The model's int8 version and the gate's remembered verdicts, as ``check`` shows them."""
    from farm.engines.gate import remembered_for
    from farm.engines.quantize import recorded

    record = recorded(spec)
    lines = [record.describe()] if record else []
    for gate in remembered_for(spec):
        lines.append(f"remembered gate on validation set {gate.validation[:12]}:")
        lines.extend(f"  {verdict.describe()}" for verdict in gate.verdicts)
    return lines


def run_check(
    spec: ModelSpec,
    count: int,
    precision: str = defaults.PRECISION,
    threads: int = 1,
    paths: Callable[[str], str] = str,
) -> str | None:
    """Run and print ``farm models check``'s comparison of every backend; why it failed, if
    it did (every backend's outputs within the tolerance, and at least one ran).  ``paths``
    rewrites each problem (``farm models add``: to name the user's files)."""
    from farm.engines.modelcheck import check_inputs, check_model

    inputs = check_inputs(spec, count)
    checks = check_model(spec, inputs, threads=threads, precision=precision)
    for check in checks:
        check.problem = paths(check.problem) if check.problem else check.problem
    click.echo(
        f"{spec.name}: {len(inputs)} images {shape_text(inputs.shape[1:])} "
        f"{inputs.dtype}; outputs must agree within {checks[-1].tolerance:g} of the "
        f"reference's largest output"
    )
    for check in checks:
        click.echo(check_line(check, len(inputs)))
    failed = [check for check in checks if not check.ok]
    if failed:
        return (
            f"model {spec.name!r} failed its check: {failed[0].backend}: "
            f"{failed[0].problem or 'outputs differ from the reference'}"
        )
    if all(check.skipped for check in checks):
        return f"model {spec.name!r}: no backend is installed to run it"
    return None


def check_line(check: BackendCheck, count: int) -> str:
    """One backend's line of ``farm models check``."""
    if check.skipped:
        return f"  {check.backend:<11} skipped: {(check.problem or '').split(' (')[0]}"
    if check.problem:
        return f"  {check.backend:<11} FAILED: {check.problem}"
    verdict = "ok" if check.ok else "DIFFERS"
    return (
        f"  {check.backend:<11} {verdict:<7} difference {check.difference:.1e}, "
        f"top-1 agrees {check.top1_agreement:.0%}, {count / check.seconds:,.0f} images/s"
    )


@models.command("quantize")
@click.argument("name")
@click.option(
    "--calibration",
    multiple=True,
    required=True,
    metavar="IMAGES",
    help="Calibration images (repeatable): folders, globs, lists of image files or a uint8 "
    ".npy, decoded as a job's are; at least 100.",
)
@click.option(
    "--count",
    default=defaults.CALIBRATION_IMAGES,
    show_default=True,
    type=click.IntRange(1),
    help="Calibration images taken from the start of IMAGES.",
)
@extra_models_option
def quantize_model(
    name: str, calibration: tuple[str, ...], count: int, models_dir: tuple[str, ...]
) -> None:
    """Make an int8 version of NAME, calibrated on the user's images.

    ONNX Runtime's static quantization (int8 weights per channel, uint8 activations)
    on farm's export of the net, preprocessing included; OpenVINO and ONNX Runtime
    run it.  It sits beside the f32 export in farm's cache, keyed by the model's and
    the calibration set's digests.  Jobs use it with --precision int8, or with
    --precision auto when its answers agree with f32's (docs/precision.md).

    \b
    Examples:
      farm models quantize squeezenet --calibration photos/
      farm models quantize lenet --calibration digits.npy --count 500
    """
    from farm.client.inputs import InputError
    from farm.client.samples import sample_of
    from farm.engines.quantize import QuantizeError, Unquantizable, quantize

    spec = find_model(name, models_dir)
    try:
        sample = sample_of(calibration, spec, count)
        click.echo(f"{spec.name}: calibrating on {sample.describe()}", err=True)
        record = quantize(spec, sample.images)
    except Unquantizable as exc:
        raise click.ClickException(f"model {spec.name!r} stays in f32: {exc}") from exc
    except (InputError, QuantizeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{record.describe()}, in {record.seconds:.1f} s: {record.path}")
    click.echo(
        f"run it with --precision int8, or --precision auto to use it where its answers "
        f"agree with f32's (farm models check {spec.name} --precision auto --validate IMAGES)"
    )


@models.command("export")
@click.argument("name")
@click.option(
    "--onnx",
    "onnx_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Write the ONNX graph here.",
)
@click.option(
    "--count",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Images to compare with the reference backend.",
)
@extra_models_option
def export_model(name: str, onnx_path: str, count: int, models_dir: tuple[str, ...]) -> None:
    """Write NAME as a checked ONNX file: onnx.checker passes it, and ONNX Runtime's outputs
    on it are compared with the reference backend's.

    The graph has a free batch dimension, ends at the model's output blob and
    computes Caffe's semantics (pooling rounding, LRN, BatchNorm's scale factor);
    preprocessing (model.toml) stays outside it.

    \b
    Examples:
      farm models export caffenet --onnx caffenet.onnx
      farm models export mynet --models-dir ~/models --onnx mynet.onnx
    """
    from farm.engines.modelcheck import check_inputs, export_checked
    from farm.modelrepo.repository import ModelError

    spec = find_model(name, models_dir)
    try:
        result = export_checked(spec, Path(onnx_path), check_inputs(spec, count))
    except (ModelError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"{spec.name}: {onnx_path} ({result.size / 1e6:.1f} MB, opset {result.opset}, "
        f"input {result.input} N x {shape_text(spec.input_shape)}, output "
        f"{result.output}); onnx.checker passed"
    )
    click.echo(
        f"  ONNX Runtime against {result.reference}: difference {result.difference:.1e} "
        f"of the largest output on {count} images"
    )
    if not result.ok:
        raise click.ClickException(f"the exported graph differs from {result.reference}")


@models.command("prepare")
@click.argument("names", nargs=-1)
@extra_models_option
def prepare_models(names: tuple[str, ...], models_dir: tuple[str, ...]) -> None:
    """Make the weights of models that generate them on first use (all such models by default).

    \b
    Examples:
      farm models prepare              # every model that needs it
      farm models prepare caffenet
      farm models quantize squeezenet --calibration photos/
    """
    from tqdm import tqdm

    from farm.modelrepo.repository import ModelError, available, load_spec, prepare

    chosen = names or tuple(available(models_dir))
    with tqdm(chosen, unit="model", file=sys.stderr, disable=len(chosen) < 2) as bar:
        for name in bar:
            bar.set_description(name)
            spec = find_model(name, models_dir) if names else load_spec(available(models_dir)[name])
            try:
                path = prepare(spec)
            except ModelError as exc:
                raise click.ClickException(str(exc)) from exc
            bar.write(
                f"{spec.name:<16} {path} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stdout
            )


def numbers(text: str, separator: str, kind: type, what: str, counts: tuple[int, ...]) -> tuple:
    """``1,2,3`` or ``3x227x227`` as numbers; click.BadParameter says the form wanted."""
    try:
        values = tuple(kind(part) for part in text.split(separator))
    except ValueError:
        values = ()
    if len(values) not in counts or (kind is int and min(values) <= 0):
        raise click.BadParameter(f"{text!r} is not {what}")
    return values


def labels_option(text: str | None) -> tuple[Path | None, tuple[str, ...]]:
    """``--labels``: a file of one class per line, else a comma-separated list of names."""
    if text is None:
        return None, ()
    if Path(text).is_file():
        return Path(text), ()
    if "," not in text:
        raise click.BadParameter(
            f"{text!r} is not a file (and not a comma-separated list of class names)",
            param_hint="--labels",
        )
    return None, tuple(label.strip() for label in text.split(","))


@models.command("add")
@click.argument("name")
@click.option(
    "--prototxt",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="The deploy prototxt.",
)
@click.option(
    "--weights",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="The trained .caffemodel.",
)
@click.option(
    "--mean-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Mean image to subtract: a Caffe .binaryproto or a .npy (C x H x W, "
    "centre-cropped when larger than the input; or C channel means).",
)
@click.option(
    "--mean",
    "mean_text",
    metavar="B,G,R",
    help="Channel means to subtract, in the net's channel order (Caffe's "
    "mean_value), e.g. 104,117,123.",
)
@click.option(
    "--scale",
    type=float,
    help="Multiply after the mean (Caffe's transform_param scale), e.g. 0.017.",
)
@click.option(
    "--raw-scale", type=float, help="Multiply the 0-255 pixels first (Caffe's raw_scale)."
)
@click.option(
    "--labels",
    "labels_text",
    metavar="FILE|A,B,...",
    help="Class names: a file with one per line (synset_words.txt), or a comma list.",
)
@click.option(
    "--channel-order",
    type=click.Choice(CHANNEL_ORDER_CHOICES),
    default="bgr",
    show_default=True,
    help="The channel order the net was trained on (images arrive RGB).",
)
@click.option(
    "--resize",
    "resize_text",
    metavar="N|HxW",
    help="Resize image files: the shorter side to N, or to exactly H x W.",
)
@click.option(
    "--crop",
    type=click.Choice(CROP_CHOICES),
    help="Then crop the net's input size: center, oversample (10 crops) or none.",
)
@click.option(
    "--input-size",
    "input_text",
    metavar="CxHxW",
    help="The input's shape, for a prototxt that does not state it.",
)
@click.option("--description", default="", help="One line for `farm models list`.")
@click.option("--link", is_flag=True, help="Symlink the files instead of copying them.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace a model of this name in the repository, or shadow a bundled (or other) one.",
)
@click.option(
    "--count",
    default=4,
    show_default=True,
    type=click.IntRange(1),
    help="Images the check compares the backends on.",
)
@models_dir_option(
    "Write the model into this repository folder [default: the first "
    "$FARM_MODELS folder, else ~/.local/share/farm/models]."
)
def add_model(
    name: str,
    prototxt: str,
    weights: str,
    mean_file: str | None,
    mean_text: str | None,
    scale: float | None,
    raw_scale: float | None,
    labels_text: str | None,
    channel_order: str,
    resize_text: str | None,
    crop: str | None,
    input_text: str | None,
    description: str,
    link: bool,
    force: bool,
    count: int,
    models_dir: tuple[str, ...],
) -> None:
    """Add a Caffe model to the repository as NAME, and check it on every backend.

    The files are copied (or linked) into REPOSITORY/NAME with a model.toml;
    images are taken as H x W x C RGB.  A failing check removes what was written.
    A NAME that a bundled model (or another on the search path) has needs --force.

    \b
    Examples:
      farm models add squeezenet --prototxt deploy.prototxt \\
          --weights squeezenet_v1.0.caffemodel --mean 104,117,123 --labels synset_words.txt
      farm models add alexnet --prototxt deploy.prototxt --weights bvlc_alexnet.caffemodel \\
          --mean-file imagenet_mean.binaryproto --resize 256 --crop center
    """
    from farm.modelrepo.modeladd import NewModel

    if mean_file and mean_text:
        raise click.UsageError("give --mean-file or --mean, not both")
    labels_file, labels = labels_option(labels_text)
    model = NewModel(
        name=name,
        prototxt=Path(prototxt),
        weights=Path(weights),
        mean_file=Path(mean_file) if mean_file else None,
        mean=numbers(mean_text, ",", float, "B,G,R channel means", (1, 3, 4)) if mean_text else (),
        input_scale=scale,
        raw_scale=raw_scale,
        labels_file=labels_file,
        labels=labels,
        channel_order=channel_order,
        resize=(numbers(resize_text, "x", int, "N or HxW", (1, 2)) if resize_text else ()),
        crop=crop,
        description=description,
        input_size=numbers(input_text, "x", int, "CxHxW", (3,)) if input_text else None,
    )
    add_checked(model, models_dir, force, link, count)


def add_checked(
    model: NewModel, models_dir: tuple[str, ...], force: bool, link: bool, count: int
) -> None:
    """Write ``model`` into the repository, check it on every backend with ``count`` images,
    and keep it only if the check passes (ClickException: nothing is left behind)."""
    from farm.modelrepo.modeladd import commit, discard, stage
    from farm.modelrepo.repository import ModelError, origin

    try:
        staged = stage(model, models_dir, force=force, link=link)
    except ModelError as exc:
        raise click.ClickException(f"not added: {exc}") from exc
    assert staged.spec is not None
    try:
        problem = run_check(staged.spec, count, paths=staged.user_paths)
    except BaseException:  # Ctrl-C, or a backend's crash: nothing is left behind either
        discard(staged)
        raise
    if problem:
        discard(staged)
        raise click.ClickException(f"{problem}; nothing was added")
    spec = commit(staged)
    click.echo(added_text(spec))
    for hidden in staged.shadows:
        click.echo(f"  it shadows {origin(hidden)}: `farm models list` shows both")


def added_text(spec: ModelSpec) -> str:
    """What ``farm models add`` wrote, and what to run next."""
    files = [
        f"    {name:<28} {size_text(path.stat().st_size):>9}"
        f"{' -> ' + str(path.resolve()) if path.is_symlink() else ''}"
        for name, path in spec.files().items()
    ]
    return "\n".join(
        [
            f"added model {spec.name!r} in {spec.folder}:",
            *files,
            f"  images {shape_text(spec.item_shape)} ({spec.preprocess.layout})"
            f"{f', {len(spec.labels)} labels' if spec.labels else ''}",
            f"next: farm run photos/ --model {spec.name} --top-k 5",
        ]
    )


def size_text(size: int) -> str:
    """Bytes for people: ``5.0 MB``, ``31.7 kB``."""
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
