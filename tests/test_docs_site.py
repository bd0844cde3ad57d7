"""The documentation site builds from docs/ in strict mode: no broken link or anchor, no
page missing from the navigation, every page reachable (`make docs` runs the same build)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for name in pages:
        html = site / ("index.html" if name == "index" else f"{name}/index.html")
        assert html.is_file(), f"docs/{name}.md was not built"
    assert (site / "img" / "perf.png").is_file()
