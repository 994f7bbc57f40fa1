"""``python -m k3verify`` is the ``k3verify`` command (for machines where it is not installed).

:func:`entry` is also the installed command's entry point: it imports the command line (and
torch with it) inside the Ctrl-C handling, so an interrupt during start-up ends like one later
on, with exit 130 and one line, not a traceback.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130


def entry() -> int:
    """Run the command line; 130 on Ctrl-C at any point, including while torch loads."""
    try:
        from .cli import main

        return main()
    except KeyboardInterrupt:
        sys.stderr.write("k3verify: error: interrupted; every write is atomic, so nothing was left half-written\n")
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(entry())
