"""``report.html`` in a real browser, for a failing MLA-only run: headless Chromium loads the
page, every image decodes, the failure comes first and links to its row, only the module that ran
is drawn, its maps fall back to the baseline's module by module, the page stays short, and the
screenshot is not blank. For a ``k3verify walk`` of two layers: the Decoder walk section's
figures decode and are laid out, and each of its tables shows its rows.

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
from plugin_site import install_plugin
from quick_forms import without_kernels

from k3verify import cli
from k3verify.cli import main
from k3verify.harness import registry

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
# The interpreter off (conftest ``without_interpreter``): the page is under test, not the kernels.
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt-get install chromium)"),
              pytest.mark.usefixtures("without_interpreter")]

# Run in the page once it has loaded: what a reader would see, as JSON in a <pre>.
PROBE = """<script>
window.addEventListener('load', () => {
  const images = [...document.images];
  const out = document.createElement('pre');
  out.id = 'k3v-probe';
  const rows = [...document.querySelectorAll('tbody tr[id^="row-"]')];
  const walk = document.getElementById('decoder-walk');
  const cells = r => [...r.cells].map(c => c.textContent);
  out.textContent = JSON.stringify({
    images: images.length,
    alts: images.map(i => i.alt),
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    headings: [...document.querySelectorAll('h2, h3')].map(h => h.textContent),
    warnings: [...document.querySelectorAll('.warn')].map(p => p.textContent),
    row_status: rows.map(r => r.className),
    row_reason: rows.map(r => r.querySelector('td.reason').textContent),
    links: [...document.querySelectorAll('ul.failures a')].map(a => {
      const target = document.querySelector(a.getAttribute('href'));
      return {text: a.textContent, target: target ? target.className : null};
    }),
    height: document.documentElement.scrollHeight,
    walk: walk && {
      headings: [...walk.querySelectorAll('h2, h3')].map(h => h.textContent),
      images: [...walk.querySelectorAll('img')].map(i => ({alt: i.alt, width: i.naturalWidth,
                                                            shown: i.getBoundingClientRect().width})),
      tables: [...walk.querySelectorAll('table')].map(t => ({header: cells(t.tHead.rows[0]),
        rows: [...t.tBodies[0].rows].map(cells), height: t.getBoundingClientRect().height})),
    },
  });
  document.body.appendChild(out);
});
</script></body>"""

# The example plugin whose MLA decode has its softmax scale 1 % off (a planted bug the bias term
# exists for), installed by hand.
BUGGY = ROOT / "examples" / "k3verify-buggy-mla" / "k3verify_buggy_mla" / "__init__.py"
WIDTH = 1400


def _chromium(*args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=15000",
             f"--window-size={WIDTH},900"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A failing MLA-only run's report, as a user gets it: its maps folder holds only KDA's map
    (an ``overflow-map --module kda`` since), so MLA's maps come from the committed baseline."""
    out = tmp_path_factory.mktemp("browser")
    fresh, site = out / "maps", out / "site"
    fresh.mkdir()
    site.mkdir()
    for png in (ROOT / "reports" / "baseline" / "maps").glob("kda_overflow_map_*.png"):
        shutil.copy(png, fresh / png.name)
    install_plugin(site, dist="k3verify-buggy-mla", module="k3verify_buggy_mla", source=BUGGY.read_text(),
                   extends="mla")
    with pytest.MonkeyPatch.context() as mp:
        without_kernels(mp, "mla")
        mp.syspath_prepend(str(site))
        mp.setattr(cli, "MAPS_SEARCH", (fresh, ROOT / "reports" / "baseline" / "maps"))
        registry.reload_plugins()
        try:
            assert main(["run", "--modules", "mla", "--out", str(out / "r")]) == 1  # the plugin fails
        finally:
            mp.undo()
            registry.reload_plugins()
    return _probe(out / "r")


def _probe(report_dir: Path) -> Path:
    """The report's page with :data:`PROBE` added, beside it."""
    probe = report_dir.parent / f"{report_dir.name}-probe.html"
    probe.write_text((report_dir / "report.html").read_text().replace("</body>", PROBE, 1))
    return probe


def _seen(page: Path) -> dict:
    """What the probe saw in Chromium."""
    done = _chromium("--dump-dom", page.as_uri())
    found = re.search(r'<pre id="k3v-probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the page did not finish loading in Chromium: {done.stderr[-1500:]}"
    return json.loads(html.unescape(found.group(1)))


@pytest.fixture(scope="module")
def seen(page: Path) -> dict:
    return _seen(page)


@pytest.fixture(scope="module")
def walk_seen(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What the probe saw of a ``k3verify walk`` report: two layers, every job, a bug planted in
    layer 1's MoE for the first-divergence search (about 3 s)."""
    out = tmp_path_factory.mktemp("browser-walk") / "walk"
    assert main(["walk", "--layers", "2", "--prompt", "8", "--decode", "1", "--workers", "1", "--plant", "1:moe",
                 "--quiet", "--out", str(out)]) == 0
    return _seen(_probe(out))


def test_every_image_loads_and_only_the_module_that_ran_is_shown(seen: dict) -> None:
    assert seen["broken"] == [], f"images that did not decode: {seen['broken']}"
    headings = seen["headings"]
    for needed in ("Failures (1)", "Verdicts", "mla", "Error against token position",
                   "ULP histograms", "Overflow map", "Notes"):
        assert any(h.startswith(needed) for h in headings), f"section {needed!r} missing: {headings}"
    # Position curve, ULP heatmap, MLA's seven maps; no KDA map although its folder was chosen,
    # no AttnRes or MoE study.
    alts = seen["alts"]
    assert len(alts) == 9 and sum(a.startswith("mla_overflow_map_") for a in alts) == 7, alts
    assert not [h for h in headings if "AttnRes" in h or "LatentMoE" in h or h == "kda"], headings


def test_the_decoder_walk_section_shows_its_figures_and_tables(walk_seen: dict, seen: dict) -> None:
    """The walk's two figures decode and are laid out at a readable width; its six tables show
    their rows (the attribution one row per module type, all, and the fp8 cache); an MLA run's
    page has no such section."""
    assert walk_seen["broken"] == [], f"images that did not decode: {walk_seen['broken']}"
    walk = walk_seen["walk"]
    assert walk["headings"] == ["Decoder walk", "fp64 agreement", "Depth drift", "Decode steps", "Attribution",
                                "Routing flips", "First divergence", "Job times"], walk["headings"]
    assert [i["alt"] for i in walk["images"]] == ["decoder walk depth drift", "decoder walk decode steps"]
    assert all(i["width"] > 500 and i["shown"] > 500 for i in walk["images"]), walk["images"]
    firsts = [t["header"][0] for t in walk["tables"]]  # growth, decode steps, attribution, flips, divergence, jobs
    assert firsts == ["plan", "curve", "module", "plan", "search", "job"], firsts
    assert all(t["rows"] and t["height"] > 20 for t in walk["tables"]), walk["tables"]
    attribution = next(t for t in walk["tables"] if t["header"][:2] == ["module", "plan"])
    assert [r[0] for r in attribution["rows"]] == ["kda", "mla", "dense", "moe", "attnres", "all", "mla fp8 cache"]
    assert all(r[3].endswith(" %") for r in attribution["rows"][:5]), attribution["rows"]
    divergence = dict(next(t for t in walk["tables"] if t["header"] == ["search", "result"])["rows"])
    assert divergence["found"] == "yes" and divergence["where"] == "sublayer call 3: layer 1 moe", divergence
    assert seen["walk"] is None


def test_failures_come_first_linked_to_their_rows_with_reasons(seen: dict) -> None:
    headings = seen["headings"]
    assert headings[0].startswith("Failures") and headings.index("Verdicts") > 0, headings
    # The verdict table opens with the failed row, its reason in its own column.
    assert seen["row_status"][0] == "fail" and seen["row_status"].count("fail") == 1, seen["row_status"][:5]
    assert "bias" in seen["row_reason"][0], seen["row_reason"][0]
    (link,) = seen["links"]
    assert link["target"] == "fail" and "buggy-scale decode" in link["text"] and "worst at [" in link["text"], link


def test_maps_fall_back_module_by_module_and_say_so(seen: dict) -> None:
    """The chosen folder had maps (KDA's), yet MLA's come from the committed baseline, with a warning."""
    (warning,) = [w for w in seen["warnings"] if "maps" in w]
    assert "Committed baseline maps" in warning and "baseline" in warning, warning


def test_an_mla_only_page_stays_short(seen: dict) -> None:
    """Rule: structural. An MLA-only page holds MLA's figures only (it was 19 500 px tall when it
    drew every module's maps); the bound leaves room for a longer verdict table."""
    print(f"page height {seen['height']} px at {WIDTH} px wide")
    assert seen["height"] < 12_000, seen["height"]


def test_the_screenshot_is_not_blank(page: Path, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "page.png"
    done = _chromium(f"--screenshot={shot}", page.as_uri())
    assert shot.exists(), done.stderr[-1500:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (WIDTH, 900)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 200, f"{len(colours)} colours: the page rendered (almost) blank"
