"""`dsv3 launch --nproc N COMMAND ...`: run a dsv3 command (train, serve, ...) on N local processes.

It starts them as ``torchrun --standalone --nproc-per-node N -m dsv3 COMMAND ...`` does, through
torch.distributed's own launcher API, but the user sees only dsv3's lines and dsv3's exit status, where
torchrun adds its own report (a ``ChildFailedError`` traceback, exit status 1) to a refused start and a
``SignalException`` traceback to a run stopped with Ctrl-C:

* bad input ends with rank 0's one ``error:`` line and exit status 2, as without a launcher;
* Ctrl-C (or SIGTERM) is passed on once to every process (torch starts each in a session of its own, out
  of the terminal's reach): a training run finishes its step, checkpoints, says how to continue and exits
  0; a second Ctrl-C interrupts at once (exit status 130);
* a process that fails otherwise (a crash, a signal) stops the others, and the launcher names its rank
  and status in one line and exits with that status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import typer

from dsv3.errors import DSV3Error, unsaid_message, was_said

REPORTED_STATUSES = (2, 130)  # a dsv3 process that exits so has said why (an error: line, "interrupted")
# The agent handles these itself (stopping the workers); SIGINT and SIGTERM are passed on to them instead.
AGENT_SIGNALS = "SIGHUP,SIGQUIT"

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True)


@app.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
def launch(
    nproc: int = typer.Option(..., help="Processes to start on this machine (torchrun's --nproc-per-node)."),
    command: list[str] = typer.Argument(..., metavar="COMMAND",
                                        help="The dsv3 command and its options, e.g. train --ep 2 ..."),
) -> None:
    """Run COMMAND on NPROC processes of one machine (gloo on CPU, NCCL on GPU), as torchrun does."""
    from dsv3.cli import COMMANDS

    if nproc < 1:
        raise DSV3Error(f"--nproc must be at least 1, got {nproc}")
    if command[0] not in COMMANDS or command[0] == "launch":
        names = ", ".join(name for name in COMMANDS if name != "launch")
        raise DSV3Error(f"dsv3 launch runs a dsv3 command ({names}), not {command[0]!r}")
    raise typer.Exit(run_processes(nproc, command))


def run_processes(nproc: int, command: list[str]) -> int:
    """Start ``python -m dsv3 COMMAND`` on ``nproc`` processes and wait for them; their exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          signals_to_handle=AGENT_SIGNALS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: one thread per process unless told
    quiet_agent()
    with passing_on(signal.SIGINT, signal.SIGTERM):
        try:
            elastic_launch(config, sys.executable)("-m", "dsv3", *command)
        except ChildFailedError as exc:
            return failed_status(exc)
    return 0


def quiet_agent() -> None:
    """Keep torch's agent from printing its own lines (what it starts and stops, a failure's report):
    what happened reaches the user as dsv3's lines and exit status."""
    agent_log = logging.getLogger("torch.distributed")  # torch gives it a handler of its own, to stderr
    agent_log.handlers = [logging.NullHandler()]
    agent_log.propagate = False


def failed_status(exc) -> int:
    """The exit status of a run whose processes failed (a torch ``ChildFailedError``), saying what went
    wrong in one line unless a process said it already: rank 0's status when it failed as dsv3 reports
    (it printed the run's line); else a line another rank left unprinted (rank 0 was stopped first); else
    the first failure, by rank and status (a crash, a signal)."""
    failures = exc.failures
    if 0 in failures and failures[0].exitcode in REPORTED_STATUSES:
        return failures[0].exitcode
    said = [f for f in failures.values() if was_said(f.error_file_data)]
    if said:  # printed by a process the agent then stopped (its status is the signal's, not dsv3's)
        return 2
    unsaid = [f for f in failures.values() if unsaid_message(f.error_file_data)]
    if unsaid:
        print(f"error: {unsaid_message(unsaid[0].error_file_data)}", file=sys.stderr)
        return unsaid[0].exitcode
    rank, first = exc.get_first_failure()
    status = first.exitcode if first.exitcode >= 0 else 128 - first.exitcode
    if status not in REPORTED_STATUSES:
        how = f"was killed by {first.signal_name()}" if first.exitcode < 0 else f"exited with status {status}"
        print(f"error: the process of rank {rank} {how}; the run stopped", file=sys.stderr)
    return status


@contextlib.contextmanager
def passing_on(*signals: signal.Signals) -> Iterator[None]:
    """Within the block, these signals reach this process's children (the workers) instead of it; one
    that comes before there are any interrupts the launcher itself."""

    def pass_on(signum, _frame) -> None:
        workers = child_pids(os.getpid())
        if not workers:
            raise KeyboardInterrupt
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent``: from /proc on Linux, else from ``ps``."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
        pairs = [line.split() for line in listing.splitlines()]
        return [int(pid) for pid, ppid in pairs if int(ppid) == parent]
    children = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # after "pid (name)"
                if int(fields[1]) == parent:
                    children.append(int(entry.name))
    return children
