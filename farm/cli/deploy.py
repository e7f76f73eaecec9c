"""``farm deploy``: configuration that runs a standing farm under a process supervisor."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import click
from click.core import ParameterSource

from farm import defaults
from farm.cli.options import models_dir_option
from farm.deploy import default_farm_command, plan, render
from farm.policies import POLICIES


def invocation(ctx: click.Context) -> str:
    """The options given for this run, as a command line."""
    words = ctx.command_path.split()
    for param in ctx.command.params:
        if param.name is None or \
                ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            continue
        flag = max(param.opts, key=len)
        value = ctx.params[param.name]
        if isinstance(param, click.Option) and param.is_flag:
            words.append(flag)
            continue
        for item in value if param.multiple else (value,):
            text = str(item)
            words += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return shlex.join(words)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def deploy() -> None:
    """Generate configuration that runs a standing farm under a process supervisor.

    \b
    Example:
      farm deploy supervisord --gpus 0,1 --model lenet -o farm.conf
      mkdir -p /tmp/farm && supervisord -c farm.conf
    """


@deploy.command()
@click.option("--cpus", help="Cores to use, like 0-7 or 0,2,4-6 [default: every core this "
                             "process may run on].")
@click.option("--gpus", default="", help="GPUs to run a worker on, like 0,1 [default: none]; "
                                         "each takes the highest free core to feed it.")
@click.option("--bind", default=defaults.BROKER_ENDPOINT, show_default=True,
              help="Endpoint the broker binds.")
@click.option("--connect", help="Endpoint workers connect to [default: --bind's port on "
                                "127.0.0.1 when it binds every interface].")
@click.option("--algo", default=defaults.POLICY, show_default=True,
              type=click.Choice(list(POLICIES)), help="Scheduling policy of the broker.")
@click.option("--model", "models", multiple=True, help="Model workers load at start (repeatable).")
@models_dir_option("Model repository folder for the broker and workers (repeatable; "
                   "written as an absolute path).")
@click.option("--run-dir", default=defaults.RUN_DIR, show_default=True,
              type=click.Path(file_okay=False),
              help="Folder of supervisord's socket, pidfile and every log.")
@click.option("--broker-arg", "broker_args", multiple=True,
              help="Extra argument for the broker, verbatim (repeatable): "
                   "--broker-arg=--heartbeat --broker-arg=0.5")
@click.option("--worker-arg", "worker_args", multiple=True,
              help="Extra argument for every worker, verbatim (repeatable): "
                   "--worker-arg=--slots --worker-arg=3")
@click.option("--curve", type=click.Path(file_okay=False),
              help="A `farm keys` folder: broker and workers use CurveZMQ (--curve DIR).")
@click.option("--no-broker", is_flag=True,
              help="Workers only, for hosts that serve a broker elsewhere (needs --connect).")
@click.option("--farm-command", default=default_farm_command,
              show_default="this Python's -m farm",
              help="Command that runs farm in the configuration, e.g. farm.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write the configuration here [default: stdout].")
@click.pass_context
def supervisord(ctx: click.Context, cpus: str | None, gpus: str, bind: str,
                connect: str | None, algo: str, models: tuple[str, ...],
                models_dir: tuple[str, ...], run_dir: str,
                broker_args: tuple[str, ...], worker_args: tuple[str, ...], curve: str | None,
                no_broker: bool, farm_command: str, output: str | None) -> None:
    """Write a supervisord configuration: a broker and one pinned worker per core and GPU.

    \b
    Examples:
      farm deploy supervisord -o farm.conf                   # every core, broker on :5555
      farm deploy supervisord --cpus 0-15 --gpus 0,1 --bind 'tcp://*:5555' -o farm.conf
      farm deploy supervisord --no-broker --connect tcp://10.0.0.1:5555 -o workers.conf
      farm deploy supervisord --bind 'tcp://*:5555' --curve /etc/farm/keys -o farm.conf
    """
    if no_broker and connect is None:
        raise click.UsageError("--no-broker: give --connect, the broker's endpoint as seen "
                               "from this host")
    folders = tuple(arg for folder in models_dir
                    for arg in ("--models-dir", os.path.abspath(folder)))
    broker_args, worker_args = (*folders, *broker_args), (*folders, *worker_args)
    try:
        deployment = plan(cpus=cpus, gpus=gpus, bind=bind, connect=connect, algo=algo,
                          models=models, run_dir=run_dir, broker_args=broker_args,
                          worker_args=worker_args, curve=curve, broker=not no_broker,
                          farm_command=farm_command)
        text = render(deployment, output or "supervisord.conf", invocation(ctx))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if output:
        Path(output).write_text(text)
    else:
        click.echo(text, nl=False)
