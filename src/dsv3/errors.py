"""One exception type for bad input, so every command can end with one clear line and exit 2.

Under a launcher (``dsv3 launch``, torchrun) every process of the run meets the same bad input and would
print the same line: rank 0 speaks for the run and the other ranks exit quietly with the same status,
leaving their line in the reply file torch's launcher gives each process (TORCHELASTIC_ERROR_FILE), so
that the launcher can still say it when rank 0 did not (e.g. it was stopped before it got there).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

REPLY_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torch's launcher agent for each process it starts
UNSAID = "dsv3_unsaid"  # marks a reply file's message as a line its process did not print
SAID = "dsv3_said"  # marks it as the line the run's speaker printed (the launcher must not repeat one)


class DSV3Error(Exception):
    """A problem with the user's input (config, checkpoint, flag, file) that we can name in one line."""


class RankError(DSV3Error):
    """A problem of this process alone (e.g. another process of the run died under it): every rank that
    meets one says so, naming itself, since rank 0 may not have met it (or may be the one that died)."""


def speaks_for_the_run() -> bool:
    """Whether this process reports what the whole run sees: a lone process always; under a launcher
    (which sets RANK), rank 0 only."""
    return os.environ.get("RANK", "0") == "0"


def report(exc: DSV3Error) -> None:
    """``error: ...`` on stderr, once per run: by rank 0 alone, unless the error is this rank's own; the
    other ranks leave it to their launcher."""
    speaks = isinstance(exc, RankError) or speaks_for_the_run()
    _reply(str(exc), SAID if speaks else UNSAID)  # first: the launcher may stop this process at any time
    if speaks:
        print(f"error: {exc}", file=sys.stderr)


def _reply(message: str, mark: str) -> None:
    """The line, marked said or unsaid, in this process's launcher reply file (none without a launcher)."""
    if os.environ.get(REPLY_FILE_ENV):
        reply = {"message": message, "timestamp": int(time.time()), mark: True}  # torch's reply format
        with contextlib.suppress(OSError), open(os.environ[REPLY_FILE_ENV], "w") as f:
            json.dump(reply, f)


def unsaid_message(reply: dict) -> str | None:
    """The error line a process left unprinted in its launcher reply file (as `report` writes it), if any."""
    return reply.get("message") if reply.get(UNSAID) else None


def was_said(reply: dict) -> bool:
    """Whether a process printed the run's error line itself (`report` marks its reply file so)."""
    return bool(reply.get(SAID))
