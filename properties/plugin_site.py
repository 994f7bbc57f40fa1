"""Plugin packages installed by hand into a site folder for tests: a module and a dist-info
folder naming its entry point in k3verify's group, as pip would leave them."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path


def install_plugin(site: Path, *, dist: str, module: str, source: str, extends: str,
                   attr: str = "implementations") -> None:
    """``site/<module>.py`` holding ``source`` and ``site/<dist>-0.1.dist-info`` whose entry point
    ``extends = <module>:<attr>`` is in the ``k3verify.implementations`` group."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    # The folder's name escapes the distribution's separators as a wheel does: a finder reads the
    # name up to the first "-", and two folders of one name would be one distribution.
    info = site / f"{re.sub(r'[-_.]+', '_', dist)}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[k3verify.implementations]\n{extends} = {module}:{attr}\n")
