"""Settings from a TOML file, below options and environment variables.

Precedence, highest first: a command-line option; its environment variable
(``FARM_BROKER``, ``FARM_ALGO``... as each option's help says, else
``FARM_<COMMAND>_<OPTION>``, e.g. ``FARM_SUBMIT_PRIORITY``); the TOML file;
the built-in default.  Click applies exactly this order when the file's values
are its ``default_map``.

The file is ``--config FILE``, else ``$FARM_CONFIG``, else ``./farm.toml``,
else ``~/.config/farm/farm.toml``.  Top-level keys apply to every command that
has such an option; a table applies to one command (``[submit]``) or a
subcommand (``[models.list]``).  Keys are option names without the dashes, or
the parameter names ``--help`` documents (the broker's address is
``broker-address`` at the top level, where ``broker`` names the broker's own
table)::

    broker-address = "tcp://10.0.0.1:5555"   # farm worker, submit and status
    curve = "/etc/farm/keys"

    [broker]
    bind = "tcp://0.0.0.0:5555"
    algo = "fast-split"
    ratio = "0.5"
    metrics-port = 9100

    [submit]
    priority = 5
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import click

CONFIG_ENV = "FARM_CONFIG"
SEARCHED = (Path("farm.toml"), Path("~/.config/farm/farm.toml"))


class ConfigError(click.ClickException):
    """A configuration file that cannot be read or names an unknown option."""


def config_path(explicit: str | None) -> Path | None:
    """The file in effect: the one given, else $FARM_CONFIG, else the first that exists."""
    named = explicit or os.environ.get(CONFIG_ENV)
    if named:
        return Path(named).expanduser()
    return next((path.expanduser() for path in SEARCHED if path.expanduser().is_file()), None)


def load_config(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def default_map(
    command: click.Command,
    settings: dict[str, Any],
    path: Path,
    shared: dict[str, Any] | None = None,
    where: str = "",
) -> dict[str, Any]:
    """Click's ``default_map`` for ``command`` from the file's ``settings``.

    ``shared``: the top-level keys, offered to every command that has the option.
    """
    shared = dict(shared or {})
    subcommands = getattr(command, "commands", {})
    options = option_names(command)
    mapped: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict) and key in subcommands:
            continue
        name = options.get(key.replace("_", "-"))
        if name is None and not where:
            shared[key] = value  # a top-level key: for whichever commands have it
            continue
        if name is None:
            known = ", ".join(sorted(options)) or "none"
            raise ConfigError(f"{path}: [{where}] has no option {key!r} (options: {known})")
        mapped[name] = value
    for key, value in shared.items():
        name = options.get(key.replace("_", "-"))
        if name is not None:
            mapped.setdefault(name, value)
    for name, sub in subcommands.items():
        table = settings.get(name)
        mapped[name] = default_map(
            sub,
            table if isinstance(table, dict) else {},
            path,
            shared,
            f"{where}.{name}".strip("."),
        )
    if not where:
        unused = set(shared) - used_names(command)
        if unused:
            raise ConfigError(f"{path}: no command has an option {sorted(unused)[0]!r}")
    return mapped


def option_names(command: click.Command) -> dict[str, str]:
    """Option flag (without dashes) or parameter name (dashed) -> parameter name, for the
    command's own options."""
    names = {}
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            names[param.name.replace("_", "-")] = param.name
            for flag in param.opts:
                if flag.startswith("--"):
                    names[flag[2:]] = param.name
    return names


def used_names(command: click.Command) -> set[str]:
    """Every option flag (without dashes) of the command and its subcommands, in both
    spellings (``max-attempts`` and ``max_attempts``)."""
    names = set()
    for flag in option_names(command):
        names |= {flag, flag.replace("-", "_")}
    for sub in getattr(command, "commands", {}).values():
        names |= used_names(sub)
    return names
