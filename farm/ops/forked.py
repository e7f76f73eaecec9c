"""A broker or worker run in a forked child of this process: what ``farm broker`` or
``farm worker`` would run, without starting an interpreter and importing numpy, zmq and
farm again.  A child gets SIGTERM when its parent dies.

``farm run`` and ``farm up`` start their broker and workers this way: a child costs a
fork, not a Python start-up, which on a small machine is most of a farm's start.  The
child calls the function it is given (``farm.ops.roles``: the same typed entry points as
the commands), then leaves with ``os._exit`` (the parent's exit handlers and buffers are
the parent's).  Fork before this process has threads of its own or a zmq context in use:
a child inherits neither safely.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from farm import startup

PR_SET_PDEATHSIG = 1

#: Signals the parent may handle its own way: a child starts with Python's defaults.
RESET_SIGNALS: dict[signal.Signals, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGHUP: signal.SIG_DFL,
}


@dataclass
class ForkedCommand:
    """A forked child, with the part of ``subprocess.Popen``'s interface that a local farm
    uses (poll, wait, send_signal, kill, stdout, args, pid); ``args`` names what it runs."""

    args: list[str]
    pid: int
    stdout: IO[str] | None = None  # never piped: a forked child writes to this one's
    returncode: int | None = field(default=None, init=False)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` if still running after ``timeout``."""
        if self.poll() is None and timeout is not None:
            wait_exited(self.pid, timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def wait_exited(pid: int, seconds: float) -> bool:
    """Whether ``pid`` exits (or has) within ``seconds``, our child or not: its pidfd
    becomes readable then.  It is not reaped."""
    try:
        descriptor = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([descriptor], [], [], seconds)[0])
    finally:
        os.close(descriptor)


def fork_call(
    function: Callable[[], None], name: list[str], new_session: bool = True
) -> ForkedCommand:
    """Call ``function`` in a forked child, named ``name`` (``["farm", "broker"]``) in
    errors; ``new_session``: a Ctrl-C at the terminal reaches this process, not the child.
    Its exit code: 0 once ``function`` returns, 1 if it raised."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        startup.forked_at = time.time()
        run_child(function, new_session)
    return ForkedCommand(name, pid)


def stop_with_parent() -> None:
    """SIGTERM this process when its parent dies, even by SIGKILL: a killed ``farm run``
    or ``farm up`` leaves no broker or worker behind (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: a child outlives a killed parent, as an exec'd one does


def run_child(function: Callable[[], None], new_session: bool) -> None:
    code = 1
    try:
        parent = os.getppid()
        stop_with_parent()
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
        if new_session:
            os.setsid()
        for signum, handler in RESET_SIGNALS.items():
            signal.signal(signum, handler)
        function()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        pass
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
