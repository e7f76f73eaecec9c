"""``--algo`` and the policy parameters (broker, run, submit), checked against the policy."""

from __future__ import annotations

from typing import Any

import click

from farm import defaults
from farm.cli.options import Command, Decorator
from farm.policies import DEFAULT_FLOOR, POLICIES, parameters

#: Policy parameter options: (option, parameter, type, help).
POLICY_OPTIONS: tuple[tuple[str, str, click.ParamType | type, str], ...] = (
    ("--chunk", "chunk", click.IntRange(1), "fifo: items per chunk (paper: 500-3000)."),
    (
        "--probe",
        "probe",
        click.IntRange(1),
        "quick, fast-split, equal-finish: probe size per worker.",
    ),
    ("--slice", "slice", click.IntRange(1), "sliced, hat: items per round (hat: the first)."),
    (
        "--ratio",
        "ratio",
        str,
        "fast-split: share r of what remains (0.25-0.5); static: ratios r1,r2,... by worker.",
    ),
    (
        "--tolerance",
        "tolerance",
        click.FloatRange(0, 1, max_open=True),
        "hat: finish times this close (fraction) end the doubling.",
    ),
    (
        "--fraction",
        "fraction",
        click.FloatRange(0, 1, min_open=True),
        "equal-finish: part of a worker's equal-finish share given per chunk.",
    ),
    (
        "--floor",
        "floor",
        click.IntRange(1),
        f"Smallest chunk a policy cuts (except the last) [default: {DEFAULT_FLOOR}].",
    ),
    (
        "--speed-alpha",
        "speed_alpha",
        click.FloatRange(0, 1),
        "Weight of the newest chunk in speed estimates (1: last chunk, 0: cumulative).",
    ),
    (
        "--speed-window",
        "speed_window",
        click.FloatRange(0),
        "equal-finish: seconds of compute that weigh as much as all earlier speed measurements.",
    ),
)


def policy_options(per_job: bool = False) -> Decorator:
    """``--algo`` and every policy parameter; unset parameters keep the policy's default.

    ``per_job``: for ``farm submit``, where no ``--algo`` means the broker's policy.
    """

    def decorate(function: Command) -> Command:
        for flag, name, kind, text in reversed(POLICY_OPTIONS):
            function = click.option(flag, name, type=kind, default=None, help=text)(function)
        if per_job:
            return click.option(
                "--algo",
                type=click.Choice(list(POLICIES)),
                help="A scheduling policy for this job only [default: the broker's].",
            )(function)
        return click.option(
            "--algo",
            default=defaults.POLICY,
            show_default=True,
            envvar="FARM_ALGO",
            show_envvar=True,
            type=click.Choice(list(POLICIES)),
            help="Scheduling policy (see docs/scheduling.md).",
        )(function)

    return decorate


def policy_params(algo: str, options: dict[str, Any]) -> dict[str, Any]:
    """The policy parameters given on the command line, converted and checked against ``algo``."""
    params = {
        name: options[name] for _, name, _, _ in POLICY_OPTIONS if options.get(name) is not None
    }
    if "ratio" in params:
        params["ratio"] = parse_ratio(algo, params["ratio"])
    unknown = sorted(set(params) - set(parameters(algo)))
    if unknown:
        flags = ", ".join("--" + name.replace("_", "-") for name in unknown)
        raise click.UsageError(f"policy {algo} does not take {flags}")
    return params


def parse_ratio(algo: str, text: str) -> float | tuple[float, ...]:
    """``--ratio``: one share (fast-split) or one ratio per worker (static)."""
    try:
        ratios = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"not a number or list of numbers: {text}", param_hint="--ratio"
        ) from None
    if algo != "static" and len(ratios) != 1:
        raise click.BadParameter(f"{algo} takes one ratio", param_hint="--ratio")
    return ratios if algo == "static" else ratios[0]
