"""``python -m k3verify`` is the ``k3verify`` command (for machines where it is not installed).

:func:`entry` is also the installed command's entry point: it imports the command line (and
torch with it) inside the Ctrl-C handling, so an interrupt during start-up ends like one later
on, with exit 130 and one line, not a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130


def _leave_interrupted() -> None:
    """Exit 130 at once. CPython remembers a KeyboardInterrupt that passed through C code running
    Python source (torch's import does) and, at shutdown, kills itself with SIGINT even though the
    interrupt was handled; skipping the shutdown keeps the status that was promised. Every file
    was already closed or rolled back while the interrupt unwound."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


def entry() -> int:
    """Run the command line; 130 on Ctrl-C at any point, including while torch loads."""
    try:
        try:
            from .cli import main

            code = main()
        finally:
            # The work is done (or was interrupted): a Ctrl-C from here on would only turn the exit
            # status into death by signal, so it is ignored.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        sys.stderr.write("k3verify: error: interrupted; every write is atomic, so nothing was left half-written\n")
        code = INTERRUPTED
    if code == INTERRUPTED:
        _leave_interrupted()
    return code


if __name__ == "__main__":
    sys.exit(entry())
