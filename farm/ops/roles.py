"""A farm's two roles, given typed settings: ``BrokerConfig`` and ``WorkerConfig``.

``farm broker`` and ``farm worker`` build these from their options; a local farm builds
them from its own fields.  Either way the process ends in the same entry point,
``serve_broker`` or ``serve_worker``.  A process started by exec (a launcher, a test's
farm) gets the same settings back as command-line arguments (``broker_arguments``,
``worker_arguments``): argv only where there is a real process boundary.

A broker tells whoever started it where it listens through a pipe (``send_endpoint``),
not through a line of its log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from farm.broker.broker import Broker, BrokerConfig
    from farm.workers.config import WorkerConfig

#: Settings whose option is the field's name with dashes: given where not the default.
BROKER_FIELDS = (
    "heartbeat",
    "liveness",
    "max_attempts",
    "max_runs",
    "sharing",
    "max_chunk_seconds",
    "verify",
    "backup_share",
)
WORKER_FIELDS = ("backend", "precision", "batch", "slots", "max_tasks", "heartbeat", "liveness")


def serve_broker(
    config: BrokerConfig,
    endpoint_fd: int | None = None,
    on_bound: Callable[[Broker], None] | None = None,
) -> None:
    """Serve as a broker until SIGINT/SIGTERM; once bound, send the endpoint down
    ``endpoint_fd`` (if given), then call ``on_bound``."""
    from farm.broker.broker import serve

    def bound(broker: Broker) -> None:
        if endpoint_fd is not None:
            send_endpoint(endpoint_fd, broker.endpoint)
        if on_bound is not None:
            on_bound(broker)

    serve(config, on_bound=bound)


def serve_worker(config: WorkerConfig) -> None:
    """Serve as a worker until SIGINT/SIGTERM (or ``max_tasks`` chunks)."""
    from farm.workers.worker import serve

    serve(config)


@contextlib.contextmanager
def reported_as_errors(*errors: type[Exception]) -> Iterator[None]:
    """In a forked child, the errors its command reports in one line (``Error: ...``, exit
    1) reported the same way, not as a traceback."""
    try:
        yield
    except errors as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def send_endpoint(fd: int, endpoint: str) -> None:
    """Write ``endpoint`` and a newline to ``fd``, then close it: the reader sees the line,
    then end of file."""
    with os.fdopen(fd, "w", closefd=True) as pipe:
        pipe.write(endpoint + "\n")


def set_log_level(level: str) -> None:
    """A forked child's threshold: the handlers it inherited, at ``level`` (a process with
    none gets farm's own)."""
    root = logging.getLogger()
    if not root.handlers:
        from farm.ops.logs import setup_logging

        setup_logging(level)
    root.setLevel(level.upper())


def option(name: str, value: Any) -> list[str]:
    """``--name VALUE`` (``max_runs`` is ``--max-runs``; a tuple is comma-separated)."""
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    return ["--" + name.replace("_", "-"), text]


def policy_arguments(params: dict[str, Any]) -> list[str]:
    """Policy parameters as ``farm broker`` arguments (``{"ratio": (1, 3)}``: --ratio 1,3)."""
    return [argument for name, value in params.items() for argument in option(name, value)]


def changed(config: Any, names: tuple[str, ...]) -> list[str]:
    """``--name VALUE`` for each of ``names`` whose value is not the dataclass's default."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return [
        argument
        for name in names
        if (value := getattr(config, name)) is not None and value != defaults[name]
        for argument in option(name, value)
    ]


def repeated(flag: str, values: tuple[str, ...]) -> list[str]:
    """``flag`` before each value (``--models-dir A --models-dir B``)."""
    return [argument for value in values for argument in (flag, value)]


def broker_arguments(config: BrokerConfig) -> list[str]:
    """``farm broker`` arguments that build ``config`` again (the inverse of the command)."""
    arguments = ["--bind", config.bind, "--algo", config.algo, *policy_arguments(config.params)]
    arguments += changed(config, BROKER_FIELDS)
    arguments += repeated("--models-dir", config.model_dirs)
    if config.curve:
        arguments += ["--curve", config.curve]
    if config.metrics is not None:
        host, port = config.metrics
        arguments += ["--metrics-host", host, "--metrics-port", str(port)]
    return arguments


def worker_arguments(config: WorkerConfig, device: str | None = None) -> list[str]:
    """``farm worker`` arguments that build ``config`` again; ``device``: the device as
    given (``cpu:bound`` is resolved by the worker's process, not this one)."""
    arguments = ["--device", device or str(config.device), "--broker", config.broker]
    arguments += changed(config, WORKER_FIELDS)
    arguments += repeated("--model", config.preload) + repeated("--models-dir", config.model_dirs)
    if config.cache_dir:
        arguments += ["--cache", config.cache_dir]
    if config.curve:
        arguments += ["--curve", config.curve, *changed(config, ("curve_name",))]
    if config.fail_items:
        low, high = config.fail_items
        arguments += ["--fail-items", f"{low}-{high - 1}"]
    if config.slow:
        factor, after = config.slow
        arguments += ["--slow", f"{factor!r}@{after!r}"]
    return arguments
