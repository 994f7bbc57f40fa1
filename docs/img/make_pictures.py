"""Redraw the README's two pictures: the top of the report page of a failing MLA run (the
example plugin ``examples/k3verify-buggy-mla``) and one committed overflow map.

    python docs/img/make_pictures.py     # needs Chromium (apt-get install chromium)

Writes ``docs/img/report-top.png`` and ``docs/img/kda-overflow-map.png``, each at most
:data:`WIDTH` pixels wide with a 256-colour palette.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "img"
WIDTH = 900
MAP = ROOT / "reports" / "baseline" / "maps" / "kda_overflow_map_input-worst.png"


def small(image: Image.Image, path: Path) -> None:
    """``image`` at most :data:`WIDTH` wide, as a 256-colour PNG at ``path``."""
    if image.width > WIDTH:
        image = image.resize((WIDTH, round(image.height * WIDTH / image.width)), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(buf, format="PNG", optimize=True)
    path.write_bytes(buf.getvalue())
    print(f"wrote {path.relative_to(ROOT)} ({image.width} x {image.height}, {len(buf.getvalue()) // 1024} kB)")


def report_top(tmp: Path) -> Image.Image:
    """A screenshot (1 400 x 1 000) of the top of a failing MLA run's report page."""
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(site),
                    str(ROOT / "examples" / "k3verify-buggy-mla")], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", "k3verify", "run", "--modules", "mla", "--quiet", "--out",
                           str(tmp / "r"), "--maps", str(MAP.parent)], env=env, cwd=ROOT)
    if done.returncode != 1:  # the plugin's bug must fail its row
        raise SystemExit(f"the MLA run exited {done.returncode}, not 1")
    chromium = next(p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p)
    shot = tmp / "top.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,1000", f"--screenshot={shot}", (tmp / "r" / "report.html").as_uri()],
                   check=True, capture_output=True)
    return Image.open(shot)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        small(report_top(Path(tmp)), OUT / "report-top.png")
    small(Image.open(MAP), OUT / "kda-overflow-map.png")


if __name__ == "__main__":
    main()
