"""``python -m k3verify`` is the ``k3verify`` command (for machines where it is not installed)."""

import sys

from .cli import main

sys.exit(main())
