"""``report.html`` in a real browser: headless Chromium loads the page, every image decodes,
every section is there, and the screenshot is not blank.

Rule: structural. Needs Chromium (Debian's ``chromium`` package, which ``.ci/run`` installs);
skipped, with that reason, where it is missing.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from quick_forms import without_kernels

from k3verify.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt-get install chromium)")

# Run in the page once it has loaded: what a reader would see, as JSON in a <pre>.
PROBE = """<script>
window.addEventListener('load', () => {
  const images = [...document.images];
  const out = document.createElement('pre');
  out.id = 'k3v-probe';
  out.textContent = JSON.stringify({
    images: images.length,
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    headings: [...document.querySelectorAll('h2, h3')].map(h => h.textContent),
    warnings: [...document.querySelectorAll('.warn')].map(p => p.textContent),
  });
  document.body.appendChild(out);
});
</script></body>"""


def _chromium(*args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=15000"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report of one module with the committed maps and studies beside it."""
    out = tmp_path_factory.mktemp("browser")
    maps = str(ROOT / "reports" / "baseline" / "maps")
    with pytest.MonkeyPatch.context() as mp:
        without_kernels(mp, "mla")
        assert main(["run", "--modules", "mla", "--out", str(out / "r"), "--maps", maps]) == 0
    probe = out / "probe.html"
    probe.write_text((out / "r" / "report.html").read_text().replace("</body>", PROBE, 1))
    return probe


def test_every_image_loads_and_every_section_is_there(page: Path) -> None:
    done = _chromium("--dump-dom", page.as_uri())
    found = re.search(r'<pre id="k3v-probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the page did not finish loading in Chromium: {done.stderr[-1500:]}"
    seen = json.loads(html.unescape(found.group(1)))
    assert seen["broken"] == [], f"images that did not decode: {seen['broken']}"
    headings = seen["headings"]
    for needed in ("Verdicts", "mla", "Error against token position", "ULP histograms", "Overflow map",
                   "Block AttnRes: error against depth", "Stable LatentMoE: routing flips", "Notes"):  # fmt: skip
        assert any(h.startswith(needed) for h in headings), f"section {needed!r} missing: {headings}"
    # Position curve, ULP heatmap, the maps of four modules (six for MLA alone), two studies.
    assert seen["images"] >= 10, seen
    assert seen["warnings"] and "Committed baseline maps" in seen["warnings"][0], seen["warnings"]


def test_the_screenshot_is_not_blank(page: Path, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "page.png"
    done = _chromium(f"--screenshot={shot}", "--window-size=1400,2400", page.as_uri())
    assert shot.exists(), done.stderr[-1500:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2400)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 200, f"{len(colours)} colours: the page rendered (almost) blank"
