"""``farm deploy``: configuration that runs a standing farm under a process supervisor."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from farm import defaults
from farm.cli.options import endpoint_value, models_dir_option
from farm.ops.deploy import default_farm_command, plan, render
from farm.policies import POLICIES

Command = TypeVar("Command", bound=Callable[..., Any])


def invocation(ctx: click.Context) -> str:
    """The options given for this run, as a command line."""
    words = ctx.command_path.split()
    for param in ctx.command.params:
        if (
            param.name is None
            or ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE
        ):
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


#: Options both commands take.
algo_option = click.option(
    "--algo",
    default=defaults.POLICY,
    show_default=True,
    type=click.Choice(list(POLICIES)),
    help="Scheduling policy of the broker.",
)
preload_option = click.option(
    "--model", "models", multiple=True, help="Model workers load at start (repeatable)."
)


def farm_command_option(text: str) -> Callable[[Command], Command]:
    return click.option(
        "--farm-command",
        default=default_farm_command,
        show_default="this Python's -m farm",
        help=text,
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def deploy() -> None:
    """Generate what runs a farm: a supervisord configuration, or a Slurm batch script.

    \b
    Examples:
      farm deploy supervisord --gpus 0,1 --model lenet -o farm.conf
      mkdir -p /tmp/farm && supervisord -c farm.conf
      farm deploy slurm --nodes 4 --gpus-per-node 2 --model lenet \\
          --submit 'farm submit images.npy --model lenet --out out.npy' -o farm.sbatch
      sbatch farm.sbatch
    """


@deploy.command()
@click.option(
    "--cpus",
    help="Cores to use, like 0-7 or 0,2,4-6 [default: every core this process may run on].",
)
@click.option(
    "--gpus",
    default="",
    help="GPUs to run a worker on, like 0,1 [default: none]; "
    "each takes the highest free core to feed it.",
)
@click.option(
    "--bind",
    default=defaults.BROKER_ENDPOINT,
    show_default=True,
    callback=endpoint_value,
    help="Endpoint the broker binds.",
)
@click.option(
    "--connect",
    callback=endpoint_value,
    help="Endpoint workers connect to [default: --bind's port on 127.0.0.1 when it "
    "binds every interface].",
)
@algo_option
@preload_option
@models_dir_option(
    "Model repository folder for the broker and workers (repeatable; written as an absolute path)."
)
@click.option(
    "--run-dir",
    default=defaults.RUN_DIR,
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder of supervisord's socket, pidfile and every log.",
)
@click.option(
    "--broker-arg",
    "broker_args",
    multiple=True,
    help="Extra argument for the broker, verbatim (repeatable): "
    "--broker-arg=--heartbeat --broker-arg=0.5",
)
@click.option(
    "--worker-arg",
    "worker_args",
    multiple=True,
    help="Extra argument for every worker, verbatim (repeatable): "
    "--worker-arg=--slots --worker-arg=3",
)
@click.option(
    "--curve",
    type=click.Path(file_okay=False),
    help="A `farm keys` folder: broker and workers use CurveZMQ (--curve DIR).",
)
@click.option(
    "--no-broker",
    is_flag=True,
    help="Workers only, for hosts that serve a broker elsewhere (needs --connect).",
)
@farm_command_option("Command that runs farm in the configuration, e.g. farm.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="Write the configuration here [default: stdout].",
)
@click.pass_context
def supervisord(
    ctx: click.Context,
    cpus: str | None,
    gpus: str,
    bind: str,
    connect: str | None,
    algo: str,
    models: tuple[str, ...],
    models_dir: tuple[str, ...],
    run_dir: str,
    broker_args: tuple[str, ...],
    worker_args: tuple[str, ...],
    curve: str | None,
    no_broker: bool,
    farm_command: str,
    output: str | None,
) -> None:
    """Write a supervisord configuration: a broker and one pinned worker per core and GPU.

    \b
    Examples:
      farm deploy supervisord -o farm.conf                   # every core, broker on :5555
      farm deploy supervisord --cpus 0-15 --gpus 0,1 --bind 'tcp://*:5555' -o farm.conf
      farm deploy supervisord --no-broker --connect tcp://10.0.0.1:5555 -o workers.conf
      farm deploy supervisord --bind 'tcp://*:5555' --curve /etc/farm/keys -o farm.conf
    """
    if no_broker and connect is None:
        raise click.UsageError(
            "--no-broker: give --connect, the broker's endpoint as seen from this host"
        )
    folders = tuple(
        arg for folder in models_dir for arg in ("--models-dir", os.path.abspath(folder))
    )
    broker_args, worker_args = (*folders, *broker_args), (*folders, *worker_args)
    try:
        deployment = plan(
            cpus=cpus,
            gpus=gpus,
            bind=bind,
            connect=connect,
            algo=algo,
            models=models,
            run_dir=run_dir,
            broker_args=broker_args,
            worker_args=worker_args,
            curve=curve,
            broker=not no_broker,
            farm_command=farm_command,
        )
        text = render(deployment, output or "supervisord.conf", invocation(ctx))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    write_output(text, output)


@deploy.command()
@click.option(
    "--nodes",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Nodes of the allocation (#SBATCH --nodes).",
)
@click.option(
    "--cores-per-node",
    type=click.IntRange(1),
    help="Cores to take on each node, a worker each (#SBATCH --ntasks-per-node) "
    "[default: whole nodes (--exclusive), every CPU Slurm gives].",
)
@click.option(
    "--gpus-per-node",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="GPUs on each node (#SBATCH --gres=gpu:N): a worker each, on a core of its own.",
)
@algo_option
@preload_option
@models_dir_option(
    "Model repository folder for the broker and workers (repeatable; "
    "written as an absolute path: the nodes must see it)."
)
@click.option(
    "--submit",
    "submits",
    multiple=True,
    metavar="LINE",
    help="A shell line run once every worker registered, e.g. 'farm submit "
    "images.npy --model lenet --out out.npy' (repeatable, in order); the job's "
    "exit status is the first failing line's. None: a standing farm until "
    "scancel or the time limit.",
)
@click.option(
    "--connect",
    help="Workers only, joining the broker at this endpoint (another "
    "job's farm-JOBID/endpoint); submit it as a job or a job array.",
)
@click.option(
    "--curve",
    type=click.Path(file_okay=False),
    help="A `farm keys` folder every process uses [default: fresh keys made in the "
    "job's folder, mode 0600].",
)
@click.option("--no-curve", is_flag=True, help="No CurveZMQ (a trusted cluster network).")
@click.option(
    "--port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="The broker's port; 0: any free port, read from its log.",
)
@click.option(
    "--broker-arg",
    "broker_args",
    multiple=True,
    help="Extra argument for the broker, verbatim (repeatable).",
)
@click.option(
    "--worker-arg",
    "worker_args",
    multiple=True,
    help="Extra argument for every worker, verbatim (repeatable).",
)
@click.option(
    "--sbatch",
    "sbatch_args",
    multiple=True,
    metavar="OPTION",
    help="An #SBATCH line, verbatim (repeatable): --sbatch=--time=2:00:00 "
    "--sbatch=--partition=gpu.",
)
@click.option("--job-name", default="farm", show_default=True, help="The Slurm job's name.")
@farm_command_option("Command that runs farm on the nodes, e.g. farm.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="Write the script here [default: stdout].",
)
@click.pass_context
def slurm(
    ctx: click.Context,
    nodes: int,
    cores_per_node: int | None,
    gpus_per_node: int,
    algo: str,
    models: tuple[str, ...],
    models_dir: tuple[str, ...],
    submits: tuple[str, ...],
    connect: str | None,
    curve: str | None,
    no_curve: bool,
    port: int,
    broker_args: tuple[str, ...],
    worker_args: tuple[str, ...],
    sbatch_args: tuple[str, ...],
    job_name: str,
    farm_command: str,
    output: str | None,
) -> None:
    """Write an sbatch script: a broker on the first node, a worker per core and GPU.

    Slurm places and pins every process (srun --cpu-bind=cores, --gres=gpu:1);
    the script waits for the workers to register, runs the --submit lines, and
    stops the farm at the end or on scancel.  scancel JOBID.STEP of a node's
    worker step loses that node's workers: their chunks go to the others.

    \b
    Examples:
      farm deploy slurm --nodes 4 --model lenet \\
          --submit 'farm submit images.npy --model lenet --out out.npy' -o farm.sbatch
      farm deploy slurm --nodes 2 --gpus-per-node 4 --sbatch=--time=8:00:00 -o farm.sbatch
      farm deploy slurm --connect "$(cat farm-1234/endpoint)" --curve farm-1234/keys \\
          -o more.sbatch && sbatch --array=1-4 more.sbatch     # four more nodes
    """
    from farm.ops.slurm import SlurmFarm, render

    folders = tuple(arg for d in models_dir for arg in ("--models-dir", os.path.abspath(d)))
    farm = SlurmFarm(
        farm=tuple(shlex.split(farm_command)),
        nodes=nodes,
        cores_per_node=cores_per_node,
        gpus_per_node=gpus_per_node,
        algo=algo,
        models=models,
        curve=slurm_curve(curve, no_curve),
        connect=connect,
        port=port,
        submits=submits,
        broker_args=(*folders, *broker_args),
        worker_args=(*folders, *worker_args),
        sbatch_args=sbatch_args,
        job_name=job_name,
    )
    try:
        text = render(farm, invocation(ctx))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    write_output(text, output, executable=True)


def slurm_curve(curve: str | None, no_curve: bool) -> str | None:
    """The script's keys: ``--curve`` as an absolute path, fresh keys made in the job
    (``JOB_KEYS``) by default, or None with ``--no-curve``."""
    from farm.ops.slurm import JOB_KEYS

    if curve and no_curve:
        raise click.UsageError("--curve and --no-curve contradict each other")
    return None if no_curve else os.path.abspath(curve) if curve else JOB_KEYS


def write_output(text: str, output: str | None, executable: bool = False) -> None:
    """Write ``text`` to ``output`` (``executable``: mode 0755), or to stdout without one."""
    if not output:
        click.echo(text, nl=False)
        return
    Path(output).write_text(text)
    if executable:
        Path(output).chmod(0o755)
