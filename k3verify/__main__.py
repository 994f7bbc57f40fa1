"""``python -m k3verify`` is the ``k3verify`` command (for machines where it is not installed).

:func:`entry` is also the installed command's entry point: it imports the command line (and
torch with it) inside the Ctrl-C handling, so an interrupt during start-up ends like one later
on, with exit 130 and one line, not a traceback. It also makes the standard streams safe to
use (a closed standard output is refused at once with exit 2, a reader that goes away mid-way
ends the command with exit 2) and turns a file-size limit into an error instead of a kill.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130
USAGE = 2


def _leave_interrupted() -> None:
    """Exit 130 at once. CPython remembers a KeyboardInterrupt that passed through C code running
    Python source (torch's import does) and, at shutdown, kills itself with SIGINT even though the
    interrupt was handled; skipping the shutdown keeps the status that was promised. Every file
    was already closed or rolled back while the interrupt unwound."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


def _open_standard_streams() -> bool:
    """Put /dev/null on each of descriptors 0, 1 and 2 that is closed; False if standard output was.

    A closed descriptor is the next one ``open`` returns: a report or lock file would become
    "standard output", and every print (ours, or a subprocess's) would land in it."""
    stdout_open = True
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            stdout_open = stdout_open and fd != 1
    return stdout_open


def _flushed(code: int) -> int:
    """``code``, or 2 when what is left of standard output cannot be written (its reader exited)."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # Python flushes again at exit; let that find /dev/null
        os.close(null)
        if code == 0:
            sys.stderr.write("k3verify: error: standard output was closed before everything was printed\n")
            return USAGE
    return code


def entry() -> int:
    """Run the command line; 130 on Ctrl-C at any point, including while torch loads."""
    if not _open_standard_streams():
        sys.stderr.write("k3verify: error: standard output is closed; redirect it (> /dev/null) to discard what "
                         "k3verify prints\n")
        return USAGE
    # Past a file-size limit (ulimit -f) a write then fails with EFBIG, reported in one line with
    # the previous files kept, instead of the signal killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
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
    return _flushed(code)


if __name__ == "__main__":
    sys.exit(entry())
