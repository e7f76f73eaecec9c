"""Options that several commands share, and the choices they offer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from farm import defaults
from farm.wire.engines import AUTO, BACKEND_NAMES, CASCADES, PRECISIONS, EngineChoice, is_cascade

Command = TypeVar("Command", bound=Callable[..., Any])
Decorator = Callable[[Command], Command]

#: ``--backend`` values: ``auto`` and the backends (the wire's names: the CLI starts without
#: importing the engines' modules).
BACKEND_CHOICES = (AUTO, *BACKEND_NAMES)
#: ``--precision`` values.
PRECISION_CHOICES = PRECISIONS


def heartbeat_options(function: Command) -> Command:
    """``--heartbeat`` and ``--liveness``: the Paranoid Pirate link's timers."""
    function = click.option(
        "--liveness",
        default=defaults.LIVENESS,
        show_default=True,
        type=click.IntRange(1),
        help="Heartbeats a peer may miss before it is declared gone.",
    )(function)
    return click.option(
        "--heartbeat",
        default=defaults.HEARTBEAT,
        show_default=True,
        type=click.FloatRange(defaults.MIN_HEARTBEAT, defaults.MAX_HEARTBEAT),
        help="Seconds between heartbeats.",
    )(function)


def curve_option(what: str, default_name: str | None = None) -> Decorator:
    """``--curve DIR`` (a `farm keys` folder holding ``what``), and ``--curve-name`` for peers."""

    def decorate(function: Command) -> Command:
        if default_name:
            function = click.option(
                "--curve-name",
                default=default_name,
                show_default=True,
                envvar="FARM_CURVE_NAME",
                show_envvar=True,
                help="Which key of the --curve folder to use (NAME.key_secret).",
            )(function)
        return click.option(
            "--curve",
            type=click.Path(file_okay=False),
            envvar="FARM_CURVE",
            show_envvar=True,
            help=f"Encrypt and authenticate with CurveZMQ: a `farm keys` folder with {what}.",
        )(function)

    return decorate


#: ``--curve`` and ``--curve-name`` of a client command (submit, status).
client_curve_option = curve_option(
    "the broker's public key and this client's secret key", defaults.CLIENT_KEY
)


def endpoint_value(
    context: click.Context, parameter: click.Parameter, value: str | None
) -> str | None:
    """An endpoint option's value: ``HOST:PORT`` as ``tcp://HOST:PORT``; a usage error in
    one line for anything else that is not an endpoint."""
    from farm.wire.link import parse_endpoint

    if value is None:
        return None
    try:
        return parse_endpoint(value, bind=parameter.name == "bind")
    except ValueError as exc:
        raise click.BadParameter(str(exc), context, parameter) from None


#: ``--broker`` of a client command: None finds the farm (``farm.runtime.choose_broker``).
client_broker_option = click.option(
    "--broker",
    "broker_address",
    default=None,
    envvar="FARM_BROKER",
    show_envvar=True,
    callback=endpoint_value,
    help="Broker endpoint to connect to (tcp://HOST:PORT, or HOST:PORT) [default: "
    "$FARM_BROKER, else the running `farm up` farm, else tcp://127.0.0.1:5555].",
)

#: ``--broker`` of a worker: where it finds the broker.
broker_option = click.option(
    "--broker",
    "broker_address",
    default=defaults.BROKER_ENDPOINT,
    show_default=True,
    envvar="FARM_BROKER",
    show_envvar=True,
    callback=endpoint_value,
    help="Broker endpoint to connect to (tcp://HOST:PORT, or HOST:PORT).",
)


def models_dir_option(text: str, exists: bool = False) -> Decorator:
    """``--models-dir``, repeatable: model folders searched beside $FARM_MODELS."""
    return click.option(
        "--models-dir", multiple=True, type=click.Path(file_okay=False, exists=exists), help=text
    )


def backend_option(text: str, default: str | None = None) -> Decorator:
    """``--backend``: one of ``BACKEND_CHOICES``; no default: the workers' own."""
    return click.option(
        "--backend",
        type=click.Choice(BACKEND_CHOICES),
        default=default,
        show_default=default is not None,
        help=text,
    )


def precision_option(text: str, default: str | None = None, gated: bool = False) -> Decorator:
    """``--precision``: one of ``PRECISION_CHOICES``; no default: the workers' own.
    ``gated``: also ``auto`` and the cascades (``bf16+f32``, its margin fitted on the
    validation images, or ``bf16+f32=MARGIN``), with ``--min-agreement`` and ``--validate``."""
    choices = (*PRECISION_CHOICES, "auto") if gated else PRECISION_CHOICES
    precision = click.option(
        "--precision",
        type=str if gated else click.Choice(choices),
        callback=job_precision if gated else None,
        default=default,
        show_default=default is not None,
        metavar=f"[{'|'.join((*choices, *CASCADES))}]" if gated else None,
        help=text,
    )
    if not gated:
        return precision

    def decorate(function: Command) -> Command:
        function = click.option(
            "--validate",
            "validate",
            multiple=True,
            metavar="IMAGES",
            help="auto: the images the precisions are checked on (repeatable; any input a "
            f"job takes); default: the job's first {defaults.VALIDATION_IMAGES}.",
        )(function)
        function = click.option(
            "--min-agreement",
            type=click.FloatRange(0, 100),
            default=defaults.MIN_AGREEMENT,
            show_default=True,
            metavar="PERCENT",
            help="auto: the top-1 agreement with f32 a lower precision needs.",
        )(function)
        return precision(function)

    return decorate


def job_precision(
    context: click.Context, parameter: click.Parameter, value: str | None
) -> str | None:
    """A job's ``--precision``: a precision, ``auto``, or a cascade with or without its
    margin (``bf16+f32``, ``bf16+f32=0.4``)."""
    if value is None or value in (*PRECISION_CHOICES, AUTO, *CASCADES):
        return value
    try:
        choice = EngineChoice.parse(BACKEND_NAMES[-1], value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if len(choice.precisions) != 1 or not is_cascade(choice.precisions[0]):
        raise click.BadParameter(
            f"{value!r}: use one of {', '.join((*PRECISION_CHOICES, AUTO, *CASCADES))}, or a "
            f"cascade with its margin (bf16+f32=0.4)"
        )
    return value


def worker_precision(context: click.Context, parameter: click.Parameter, value: str) -> str:
    """A worker's ``--precision``: one precision, or the precision gate's list (the worker
    reads it into its ``EngineChoice``)."""
    try:
        EngineChoice.parse(AUTO, value)
    except ValueError as exc:
        raise click.BadParameter(
            f"{exc}; use one of {', '.join(PRECISION_CHOICES)}, or the precision "
            f"gate's list (openvino:int8,bf16,f32)"
        ) from None
    return value


def image_out_options(function: Command) -> Command:
    """``--out``, ``--trace`` and ``--quiet``: what a job writes (submit, run)."""
    function = click.option("--quiet", is_flag=True, help="No progress bar.")(function)
    function = click.option(
        "--trace",
        type=click.Path(dir_okay=False),
        help="Write every chunk's worker and timings here (JSON) for `farm report`.",
    )(function)
    return click.option(
        "--out",
        type=click.Path(dir_okay=False),
        help="Write answers here (.csv or .jsonl: each image's top classes, "
        "in input order) or raw outputs (.npy).",
    )(function)


#: ``--top-k``: answers rather than raw scores (submit, run).
top_k_option = click.option(
    "--top-k",
    type=click.IntRange(1),
    metavar="K",
    help="Name each image's K best classes with their probabilities (the model's labels; a "
    "softmax where the net ends before one) [default: 5 in a .csv/.jsonl --out, 1 on "
    "the terminal for image files].",
)

#: ``--no-exif-rotate``: image files' stored pixels, their EXIF orientation ignored (submit, run).
exif_option = click.option(
    "--no-exif-rotate",
    "no_exif_rotate",
    is_flag=True,
    help="Decode image files as stored, ignoring their EXIF orientation [default: turn each "
    "one upright by it, as viewers show it].",
)

#: ``--verify``: the part of a job's images run again on another device (submit, run, broker).
verify_option = click.option(
    "--verify",
    type=click.FloatRange(0, 1),
    default=None,
    metavar="FRACTION",
    help="Run this part of the images again on another device and compare the answers "
    "(spot checks: a worker that loses one is quarantined and its chunks run again), "
    "e.g. 0.01 [default: the broker's --verify, itself 0].",
)

#: ``--model``: the model a job runs.
workers_option = click.option(
    "--workers", type=click.IntRange(1), help="Pinned workers to start (default: one per core)."
)
batch_option = click.option(
    "--batch",
    type=click.IntRange(1),
    help="The workers' compute batch [default: auto's choice, else the prototxt's].",
)

model_option = click.option(
    "--model", default=defaults.MODEL, show_default=True, help="Model to run."
)


def path_maps(
    context: click.Context, parameter: click.Parameter, values: tuple[str, ...]
) -> tuple[tuple[str, str], ...]:
    """``--path-map`` values as (client prefix, worker prefix) pairs."""
    from farm.wire.storage import parse_path_map

    try:
        return tuple(parse_path_map(value) for value in values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def shared_options(function: Command) -> Command:
    """``--shared`` and ``--path-map``: the workers read the inputs themselves (submit, run)."""
    function = click.option(
        "--path-map",
        multiple=True,
        callback=path_maps,
        metavar="CLIENT_PREFIX=WORKER_PREFIX",
        help="With --shared: the workers see paths under CLIENT_PREFIX under WORKER_PREFIX "
        "instead (repeatable; the first match wins).",
    )(function)
    return click.option(
        "--shared",
        is_flag=True,
        help="The workers read IMAGES from storage they share with this host (NFS, Lustre; "
        "image files or a uint8/float32 .npy): the broker carries paths and row ranges, "
        "not bytes.  A worker that cannot read them is sent the bytes.",
    )(function)
