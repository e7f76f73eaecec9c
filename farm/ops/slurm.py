"""A farm as a Slurm job: the sbatch script ``farm deploy slurm`` writes.

Slurm places, pins and accounts; the script only starts farm's processes inside the
allocation.  ``srun`` starts the broker on the first node (sharing its cores: it uses
little CPU), then one job step of workers per node, one task per allocated core,
each bound to its core by Slurm (``--cpu-bind=cores``, the worker's ``--device cpu:bound``
keeps it there), and one step per GPU (``--gres=gpu:1``, with a core of its own to feed
it).  Everything connects to the first node's address (its ``NodeAddr``), on the port
the broker reports once it listens.  The script waits until every worker has registered
(``farm status --wait-workers``), runs the user's ``farm submit`` lines, and stops the
farm: workers first (SIGTERM to their steps: each says goodbye), then the broker, at the
end, on ``scancel -b -s TERM`` and a minute before the time limit.  CurveZMQ keys are
made per job in the job's folder, readable by its owner alone.

Without submit lines the job is a standing farm until it is cancelled; a workers-only
script (``--connect``) joins an existing broker, as a job of its own or a job array,
so that nodes come and go while the broker runs.  ``scancel JOB.STEP`` of one node's
worker step is a lost node: the broker gives its chunks to the others.

The command itself is ``farm.cli.deploy``; this module plans and renders.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass

#: ``--curve`` value meaning: make fresh keys in the job's folder.
JOB_KEYS = "job"
#: Seconds the script gives the workers to register before it gives up.
WAIT_SECONDS = 300
#: Seconds the script gives the broker to report its port.
BROKER_START_SECONDS = 60
#: Seconds before the time limit at which Slurm asks the script to stop the farm.
STOP_BEFORE_LIMIT = 60


@dataclass(frozen=True, kw_only=True)
class SlurmFarm:
    """Everything a generated script says."""

    farm: tuple[str, ...]  # the command that runs farm on the nodes
    nodes: int = 1
    cores_per_node: int | None = None  # None: whole nodes, every CPU Slurm allocates
    gpus_per_node: int = 0
    algo: str = ""
    models: tuple[str, ...] = ()
    curve: str | None = JOB_KEYS  # a keys folder, JOB_KEYS, or None for no CURVE
    connect: str | None = None  # workers only, joining this broker
    port: int = 0  # the broker's port; 0: any free one
    submits: tuple[str, ...] = ()  # shell lines run once the workers registered
    broker_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()
    job_name: str = "farm"
    wait_seconds: int = WAIT_SECONDS

    def check(self) -> None:
        """ValueError naming the option at fault when the script could not run."""
        if self.nodes < 1:
            raise ValueError("--nodes must be at least 1")
        if self.cores_per_node is not None and self.cores_per_node < self.gpus_per_node:
            raise ValueError(
                f"--gpus-per-node {self.gpus_per_node} needs a core each to "
                f"feed it: --cores-per-node {self.cores_per_node} is too few"
            )
        if self.connect is not None and self.submits:
            raise ValueError(
                "--submit runs in the job that starts the broker, not in a "
                "workers-only job (--connect)"
            )
        if self.connect is not None and self.curve == JOB_KEYS:
            raise ValueError(
                "--connect: give the broker's keys folder with --curve DIR (on "
                "a shared file system), or --no-curve"
            )
        if self.connect is not None and (self.port or self.broker_args):
            raise ValueError(
                "--port and --broker-arg are the broker's: a workers-only job "
                "(--connect) starts none"
            )
        for text in (
            *self.submits,
            *self.sbatch_args,
            *self.models,
            *self.broker_args,
            *self.worker_args,
            *self.farm,
            self.connect or "",
            self.curve or "",
            self.algo,
        ):
            if "\n" in text or "\r" in text:
                raise ValueError(f"{text!r} must be one line")
        if not re.fullmatch(r"[\w.-]+", self.job_name):
            raise ValueError(f"--job-name {self.job_name!r}: letters, digits, '.', '_', '-'")


def render(farm: SlurmFarm, generated_by: str) -> str:
    """The sbatch script's text; ValueError if it could not run, or if bash cannot parse it
    (a submit line that is not a whole shell command)."""
    farm.check()
    text = (
        "\n".join(
            [*header(farm, generated_by.replace("\n", " ")), *directives(farm), "", *body(farm)]
        )
        + "\n"
    )
    check_syntax(text)
    return text


def check_syntax(text: str) -> None:
    """ValueError with bash's complaint when ``bash -n`` refuses the script (where bash is)."""
    bash = shutil.which("bash")
    if bash is None:
        return
    done = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ValueError(f"the script would not run: bash says {done.stderr.strip()}")


def header(farm: SlurmFarm, generated_by: str) -> list[str]:
    where = (
        f"workers joining the broker at {farm.connect}"
        if farm.connect
        else "a broker on the first node, workers on every node"
    )
    gpus = (
        f", one per GPU ({farm.gpus_per_node} a node) on a core of its own"
        if farm.gpus_per_node
        else ""
    )
    then = (
        "runs the farm submit lines below"
        if farm.submits
        else "serves until stopped or out of time"
    )
    return [
        "#!/bin/bash",
        f"# A farm as a Slurm job: {where}.",
        f"# Workers: one per allocated core, pinned by Slurm{gpus}.",
        f"# Once they have registered, the job {then}, then stops the farm cleanly:",
        "# workers first, each saying goodbye, then the broker.",
        f"# Generated by: {generated_by}",
        "#",
        "# Submit:  sbatch THIS_FILE            (output: farm-JOBID.out; files: farm-JOBID/)",
        "# Watch:   squeue -s -j JOBID          (the broker and one worker step per node)",
        "#          FARM_BROKER=$(cat farm-JOBID/endpoint) FARM_CURVE=farm-JOBID/keys farm status",
        "# Stop:    scancel -b -s TERM JOBID    (the script stops the farm cleanly; so it does",
        f"#          {STOP_BEFORE_LIMIT} s before the time limit; a plain scancel JOBID "
        "signals every process at once)",
        "# Lose a node's workers: scancel JOBID.STEP (their chunks go to the other workers)",
    ]


def directives(farm: SlurmFarm) -> list[str]:
    lines = [
        f"#SBATCH --job-name={farm.job_name}",
        f"#SBATCH --nodes={farm.nodes}",
        "#SBATCH --output=farm-%j.out",
        f"#SBATCH --signal=B:TERM@{STOP_BEFORE_LIMIT}",
    ]
    if farm.cores_per_node is None:
        lines.append("#SBATCH --exclusive")
    else:
        lines += [f"#SBATCH --ntasks-per-node={farm.cores_per_node}", "#SBATCH --cpus-per-task=1"]
    if farm.gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{farm.gpus_per_node}")
    return lines + [f"#SBATCH {arg}" for arg in farm.sbatch_args]


def words(items: tuple[str, ...]) -> str:
    return " ".join(shlex.quote(item) for item in items)


def body(farm: SlurmFarm) -> list[str]:
    """The script after its directives: settings, functions, the farm, then its use."""
    return [
        *settings_lines(farm),
        "",
        *FUNCTIONS,
        "",
        "trap 'on_signal 143' TERM",
        "trap 'on_signal 130' INT",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'read -ra CPUS <<< "$(expand_counts "$SLURM_JOB_CPUS_PER_NODE")"',
        *curve_lines(farm),
        *(connect_lines(farm) if farm.connect else [*broker_lines(farm), "BEFORE=0"]),
        *workers_lines(farm),
        *(submit_lines(farm) if farm.submits else serve_lines(farm)),
    ]


def settings_lines(farm: SlurmFarm) -> list[str]:
    """The script's variables, and a clean job folder."""
    models = words(tuple(arg for model in farm.models for arg in ("--model", model)))
    return [
        "set -u",
        f"FARM=({words(farm.farm)})",
        '# the submit lines below run this farm ("command": FARM may itself be "farm")',
        'farm() { command "${FARM[@]}" "$@"; }',
        "# what the submitter's environment says of farm is not this job's",
        "unset FARM_BROKER FARM_CURVE FARM_CURVE_NAME",
        "JOB_DIR=${FARM_JOB_DIR:-$PWD/farm-$SLURM_JOB_ID}  # beside farm-JOBID.out",
        f"GPUS_PER_NODE={farm.gpus_per_node}",
        f"MODELS=({models})",
        f"WORKER_ARGS=({words(farm.worker_args)})",
        "WORKER_PIDS=()",
        "BROKER_PID=",
        "CHILD=",
        "# a requeued job runs again with the same id: nothing of its last run is reused",
        'rm -rf "$JOB_DIR/keys" "$JOB_DIR/broker.log" "$JOB_DIR/endpoint"',
        'mkdir -p "$JOB_DIR"',
    ]


def connect_lines(farm: SlurmFarm) -> list[str]:
    """Workers for a broker already running elsewhere (``--connect``)."""
    assert farm.connect is not None
    return [
        f"export FARM_BROKER={shlex.quote(farm.connect)}",
        "# these workers come on top of those already there",
        'BEFORE=$(in_background farm status --json "${STATUS_ARGS[@]}" '
        "| count_workers) || BEFORE=0",
    ]


def workers_lines(farm: SlurmFarm) -> list[str]:
    """Start the workers and wait until they have all registered."""
    return [
        'echo "$FARM_BROKER" > "$JOB_DIR/endpoint"',
        "start_workers",
        f'if ! in_background farm status --wait-workers "$((BEFORE + WANTED))" '
        f'--timeout {farm.wait_seconds} "${{STATUS_ARGS[@]}}" > "$JOB_DIR/status.txt"; then',
        f'    say "fewer than $WANTED workers registered within {farm.wait_seconds} s; see '
        '$JOB_DIR/*.log"',
        "    stop_farm",
        "    exit 1",
        "fi",
        'say "$WANTED workers registered with the broker at $FARM_BROKER"',
    ]


def submit_lines(farm: SlurmFarm) -> list[str]:
    """Run each submit line in turn, then stop the farm; exit with the first failure's status."""
    lines = ["status=0"]
    for line in farm.submits:
        lines += [
            f"say {shlex.quote('running: ' + line)}",
            "(",
            line,
            ") &",
            "CHILD=$!",
            'wait "$CHILD" || { code=$?; ((status)) || status=$code; }',
            "CHILD=",
        ]
    return [*lines, "stop_farm", 'say "done (exit status $status)"', 'exit "$status"']


def serve_lines(farm: SlurmFarm) -> list[str]:
    """Serve until scancel or the time limit (a ``--connect`` job: until its workers end)."""
    waited = '"${WORKER_PIDS[@]}"' if farm.connect else '"$BROKER_PID"'
    return [
        'say "serving until scancel -b -s TERM $SLURM_JOB_ID or the time limit"',
        f"wait {waited}",
        "stop_farm",
    ]


def curve_lines(farm: SlurmFarm) -> list[str]:
    """CURVE_ARGS (broker, workers) and STATUS_ARGS (this script's own farm status)."""
    if farm.curve is None:
        return ["BROKER_CURVE=()", "CURVE_ARGS=()", "STATUS_ARGS=()"]
    if farm.curve == JOB_KEYS:
        return [
            '(umask 077 && farm keys init "$JOB_DIR/keys" > /dev/null) || exit 1',
            'chmod 600 "$JOB_DIR"/keys/*.key* "$JOB_DIR"/keys/authorized/*/*.key',
            'export FARM_CURVE="$JOB_DIR/keys"',
            'BROKER_CURVE=(--curve "$FARM_CURVE")',
            'CURVE_ARGS=(--curve "$FARM_CURVE" --curve-name worker)',
            'STATUS_ARGS=(--curve "$FARM_CURVE" --curve-name client)',
        ]
    # a worker host's keys folder holds the worker's secret key, not a client's
    return [
        f"export FARM_CURVE={shlex.quote(farm.curve)}",
        'BROKER_CURVE=(--curve "$FARM_CURVE")',
        'CURVE_ARGS=(--curve "$FARM_CURVE" --curve-name worker)',
        'STATUS_ARGS=(--curve "$FARM_CURVE" --curve-name worker)',
    ]


def broker_lines(farm: SlurmFarm) -> list[str]:
    args = words(("--algo", farm.algo) if farm.algo else ()) + " " + words(farm.broker_args)
    return [
        "# the broker shares the first node's cores (--overlap): it uses little CPU",
        'srun --nodes=1 --ntasks=1 --nodelist="${NODES[0]}" --overlap --cpu-bind=none \\',
        '    --gres=none --job-name=farm-broker "${FARM[@]}" broker \\',
        f'    --bind "tcp://*:{farm.port or "*"}" {args.strip()} \\',
        '    "${BROKER_CURVE[@]}" > "$JOB_DIR/broker.log" 2>&1 &',
        "BROKER_PID=$!",
        f'port=$(broker_port {BROKER_START_SECONDS}) || {{ say "the broker did not start; '
        'see $JOB_DIR/broker.log"; stop_farm; exit 1; }',
        'export FARM_BROKER="tcp://$(node_address "${NODES[0]}"):$port"',
    ]


#: Shell functions every script defines.
FUNCTIONS = r"""say() { echo "farm-slurm: $*"; }

# SLURM_JOB_CPUS_PER_NODE ("16(x2),8") as one count per node ("16 16 8")
expand_counts() {
    local part parts counts=()
    IFS=, read -ra parts <<< "$1"
    for part in "${parts[@]}"; do
        if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
            for ((i = 0; i < BASH_REMATCH[2]; i++)); do counts+=("${BASH_REMATCH[1]}"); done
        else
            counts+=("$part")
        fi
    done
    echo "${counts[@]}"
}

# the address Slurm reaches a node at (its NodeAddr: the name itself on most clusters)
node_address() {
    local address
    address=$(scontrol show node "$1" | tr " " "\n" | sed -n "s/^NodeAddr=//p" | head -n 1)
    echo "${address:-$1}"
}

# the port in the broker's first line ("farm broker listening on tcp://...:PORT")
broker_port() {
    local line
    for ((i = 0; i < $1 * 5; i++)); do
        line=$(grep -m 1 "^farm broker listening on " "$JOB_DIR/broker.log" 2>/dev/null)
        if [ -n "$line" ]; then echo "${line##*:}"; return 0; fi
        kill -0 "$BROKER_PID" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

# the number of workers in `farm status --json`'s output
count_workers() {
    grep -c '"heartbeat_age_s"' || true
}

# a command run in the background and waited for, so that a signal is handled at once
in_background() {
    "$@" &
    CHILD=$!
    wait "$CHILD"
    local code=$?
    CHILD=
    return "$code"
}

# on every node: a step of CPU workers, one task per core but those feeding GPUs, and a
# step per GPU; WANTED counts them
start_workers() {
    WANTED=0
    local i node cpu_workers
    for i in "${!NODES[@]}"; do
        node=${NODES[$i]}
        cpu_workers=$((CPUS[i] - GPUS_PER_NODE))
        if ((cpu_workers > 0)); then
            srun --nodes=1 --ntasks="$cpu_workers" --nodelist="$node" --cpus-per-task=1 \
                --exact --cpu-bind=cores --gres=none --kill-on-bad-exit=0 --wait=0 \
                --job-name="farm-workers-$node" \
                "${FARM[@]}" worker --device cpu:bound --broker "$FARM_BROKER" \
                "${MODELS[@]}" "${CURVE_ARGS[@]}" "${WORKER_ARGS[@]}" \
                > "$JOB_DIR/workers-$node.log" 2>&1 &
            WORKER_PIDS+=($!)
            WANTED=$((WANTED + cpu_workers))
        fi
        for ((g = 0; g < GPUS_PER_NODE; g++)); do
            srun --nodes=1 --ntasks=1 --nodelist="$node" --gres=gpu:1 --cpus-per-task=1 \
                --exact --cpu-bind=cores --job-name="farm-gpu-$node-$g" \
                "${FARM[@]}" worker --device gpu:0 --broker "$FARM_BROKER" \
                "${MODELS[@]}" "${CURVE_ARGS[@]}" "${WORKER_ARGS[@]}" \
                > "$JOB_DIR/gpu-$node-$g.log" 2>&1 &
            WORKER_PIDS+=($!)
            WANTED=$((WANTED + 1))
        done
    done
}

# SIGTERM to every task of this job's steps whose name matches $1 (a SIGTERM to srun
# itself would have Slurm SIGKILL its tasks, and workers owe the broker a goodbye)
signal_steps() {
    local steps
    steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk -v name="$1" '$2 ~ name {print $1}')
    if [ -n "$steps" ]; then scancel --signal=TERM $steps 2>/dev/null; fi
}

# wait up to $1 seconds for the processes $2...; then SIGTERM to those left (srun ends
# its step)
await_pids() {
    local seconds=$1 pid left
    shift
    for ((i = 0; i < seconds * 5; i++)); do
        left=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left=1; done
        ((left)) || break
        sleep 0.2
    done
    kill -TERM "$@" 2>/dev/null
    wait "$@" 2>/dev/null
}

# workers first (their goodbyes reach a live broker), then the broker
stop_farm() {
    trap '' TERM INT
    if ((${#WORKER_PIDS[@]})); then
        signal_steps "^farm-(workers|gpu)-"
        await_pids 30 "${WORKER_PIDS[@]}"
    fi
    if [ -n "$BROKER_PID" ]; then
        signal_steps "^farm-broker$"
        await_pids 30 "$BROKER_PID"
    fi
}

# SIGTERM (scancel -b -s TERM, the time limit coming) or SIGINT: stop what runs, then the
# farm
on_signal() {
    say "stopping: signalled (scancel or the time limit)"
    if [ -n "$CHILD" ]; then  # a subshell: its command first
        pkill -TERM -P "$CHILD" 2>/dev/null
        kill -TERM "$CHILD" 2>/dev/null
        wait "$CHILD" 2>/dev/null
    fi
    stop_farm
    exit "$1"
}""".splitlines()
