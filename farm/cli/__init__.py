"""The ``farm`` command: a thin click group over the broker, workers and client.

One module per command or group (``broker``, ``worker``, ``submit`` with ``run``
and ``status``, ``local`` with ``up`` and ``down``, ``report``, ``models``, ``keys``,
``deploy``, ``bench``); options several of them share are in ``options`` and
``policy``.  A command's module is imported only when that command runs (``COMMANDS``),
and commands import what they run when they run: ``farm worker`` loads neither the
client nor the broker, and ``farm broker --help`` no inference library.

Every option can also come from an environment variable (named in its help,
else ``FARM_<COMMAND>_<OPTION>``) or a TOML file (``farm.ops.config``), in that order
of precedence after the command line.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import click

from farm import defaults

#: Commands that run for a long time and log as they go: INFO by default; others WARNING.
SERVICES = ("broker", "worker", "up")
#: Commands that look models up by name: a ``$FARM_MODELS`` entry that is no folder is
#: said at their start (``farm models add`` creates it, so it is not said there).
SEARCH_MODELS = ("run", "up", "submit", "broker", "worker", "bench")

#: Each command: the ``farm.cli`` module that defines it, and its function there.
COMMANDS = {
    "run": ("run", "run"),
    "up": ("local", "up"),
    "down": ("local", "down"),
    "submit": ("submit", "submit"),
    "status": ("submit", "status"),
    "broker": ("broker", "broker"),
    "worker": ("worker", "worker"),
    "report": ("report", "report"),
    "models": ("models", "models"),
    "keys": ("keys", "keys"),
    "deploy": ("deploy", "deploy"),
    "bench": ("bench", "bench"),
}


class FarmGroup(click.Group):
    """A click group that imports a command's module only when the command is used, and
    reports a farm error as one line, not a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, name = COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(f"farm.cli.{module}"), name))
        return self.commands.get(cmd_name)

    def load_all(self, ctx: click.Context) -> None:
        """Import every command (a settings file is checked against all their options)."""
        for name in COMMANDS:
            self.get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            from farm.client.client import FarmError  # the commands that raise it loaded it

            if isinstance(exc, FarmError):
                raise click.ClickException(str(exc)) from exc
            raise


@click.group(
    cls=FarmGroup,
    context_settings={
        "help_option_names": ["-h", "--help"],
        "auto_envvar_prefix": "FARM",
        "max_content_width": 100,
    },
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    envvar="FARM_CONFIG",
    show_envvar=True,
    help="TOML settings file [default: ./farm.toml, else ~/.config/farm/farm.toml].",
)
@click.option(
    "--log-level",
    envvar="FARM_LOG_LEVEL",
    show_envvar=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help=f"Logging threshold, logs on stderr [default: {defaults.SERVICE_LOG_LEVEL} "
    f"for broker and worker, {defaults.LOG_LEVEL} for the rest].",
)
@click.option(
    "--log-format",
    envvar="FARM_LOG_FORMAT",
    show_envvar=True,
    type=click.Choice(["text", "json"]),
    help="text for people, json (one object per line) for log shippers "
    f"[default: {defaults.LOG_FORMAT}].",
)
@click.version_option(package_name="farm")
@click.pass_context
def main(
    ctx: click.Context, config_file: str | None, log_level: str | None, log_format: str | None
) -> None:
    """farm: Caffe-model inference spread over every core of one or many machines.

    \b
    Quick start (one machine, no setup):
      farm run images.npy --model lenet
    A farm by hand:
      farm broker --bind tcp://127.0.0.1:5555
      farm worker --device cpu:0 --broker tcp://127.0.0.1:5555
      farm submit images.npy --model lenet --out scores.npy --trace run.json
      farm status --watch
      farm report run.json -o run.png
    Settings: option > environment (FARM_BROKER, ...) > farm.toml (see docs/operating.md).
    """
    from farm.ops.logs import setup_logging

    apply_config_file(ctx, config_file)
    default_level = (
        defaults.SERVICE_LOG_LEVEL if ctx.invoked_subcommand in SERVICES else defaults.LOG_LEVEL
    )
    setup_logging(
        ctx.params["log_level"] or default_level, ctx.params["log_format"] or defaults.LOG_FORMAT
    )
    if ctx.invoked_subcommand in SEARCH_MODELS:
        from farm.modelrepo.repository import missing_env_models_dirs

        for warning in missing_env_models_dirs():
            logging.getLogger("farm").warning(warning)


def apply_config_file(ctx: click.Context, config_file: str | None) -> None:
    """The TOML file's settings become the commands' defaults, and the group's own options
    (parsed before the file was read) take the file's values where the command line and the
    environment left them unset."""
    from farm.ops.config import ConfigError, config_path, default_map, load_config

    path = config_path(config_file)
    if path is None:
        return
    if isinstance(ctx.command, FarmGroup):
        ctx.command.load_all(ctx)
    settings = default_map(ctx.command, load_config(path), path)
    ctx.default_map = settings
    for param in ctx.command.params:
        name = param.name or ""
        if name in settings and ctx.params.get(name) is None:
            try:
                ctx.params[name] = param.type_cast_value(ctx, settings[name])
            except click.BadParameter as exc:
                raise ConfigError(f"{path}: {name.replace('_', '-')}: {exc.message}") from exc
