"""The README's and the docs' snippets stay true: each block marked ``<!-- tested: exec -->``
runs as written (``sh`` blocks in bash, from a folder beside the examples; a ``text`` block
marked ``<!-- tested: output -->`` right after one is what it prints), and each marked
``<!-- tested: FILE#REGION -->`` is, word for word, the region of an example file that its
own test runs. The performance table (README, docs/performance.md) is the one
``docs/perf_plot.py`` prints from the benchmark results."""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p.relative_to(ROOT).as_posix(): p.read_text() for p in PAGES}
BLOCK = re.compile(r"<!-- tested: (\S+) -->\n```(python|sh|text)\n(.*?)```", re.S)
# (page, target, code) of every tested block, in page order.
FOUND = [
    (page, target, lang, code) for page, text in TEXT.items() for target, lang, code in BLOCK.findall(text)
]
BLOCKS = [(page, target, code) for page, target, lang, code in FOUND if lang == "python"]
SHELL = [(page, code) for page, target, lang, code in FOUND if lang == "sh" and target == "sh"]
# What an exec block prints, where the next tested block is its output.
PRINTS = {
    (page, code): nxt[3]
    for (page, target, lang, code), nxt in zip(FOUND, FOUND[1:])
    if target == "exec" and nxt[1] == "output" and nxt[0] == page
}


def _id(page: str, code: str) -> str:
    first = next((line for line in code.splitlines() if line and not line.startswith(("import", "#"))), "")
    return f"{page}:{first[:30]}"


def region(path: Path, name: str) -> str:
    text = path.read_text()
    pattern = rf"^[ \t]*# --8<-- \[start:{name}\]\n(.*?)^[ \t]*# --8<-- \[end:{name}\]\n"
    m = re.search(pattern, text, re.S | re.M)
    assert m, f"no region {name!r} in {path}"
    return textwrap.dedent(m.group(1))


def test_every_page_has_its_tested_snippets():
    # A typo in a marker would silently drop a block from the tests.
    for page, text in TEXT.items():
        assert text.count("<!-- tested: ") == len(BLOCK.findall(text)), f"{page}: a marker without its block"
    assert len(BLOCKS) + len(SHELL) >= 15
    outputs = [b for b in FOUND if b[1] == "output"]
    assert len(outputs) == len(PRINTS), "an output block must follow the exec block that prints it"


def test_every_section_on_integrations_has_a_tested_snippet():
    sections = re.split(r"\n## ", TEXT["docs/integrations.md"])[1:]
    assert len(sections) >= 5
    for sec in sections:
        assert "<!-- tested: " in sec, f"section {sec.splitlines()[0]!r} has no tested snippet"


@pytest.mark.parametrize(
    "page, target, code",
    [b for b in BLOCKS if b[1] != "exec"],
    ids=[_id(b[0], b[2]) for b in BLOCKS if b[1] != "exec"],
)
def test_snippet_is_the_example_region(page, target, code):
    path, name = target.split("#")
    assert region(ROOT / path, name) == code


EXEC = [(b[0], b[2]) for b in BLOCKS if b[1] == "exec"]


@pytest.mark.parametrize("page, code", EXEC, ids=[_id(*b) for b in EXEC])
def test_snippet_runs(page, code, tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, page, "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(cwd)
    printed = capsys.readouterr().out
    if (page, code) in PRINTS:
        assert printed == PRINTS[page, code]


@pytest.mark.parametrize("page, code", SHELL, ids=[_id(*b) for b in SHELL])
def test_shell_snippet_runs(page, code, tmp_path):
    """Run as a user would from a checkout: `python` is this interpreter, fuser importable;
    the examples are linked in so that files the snippet writes stay in the temp folder."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("FUSER_CACHE_DIR", None)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    if "fuser precompile" in code:
        # The precompiled kernel is the one the training job loads: it compiles nothing.
        assert "1 compiled" in done.stdout and "'compiles': 0" in done.stdout
        assert (tmp_path / "fuser-cache").is_dir()


def test_performance_table_is_the_results():
    spec = importlib.util.spec_from_file_location("perf_plot", ROOT / "docs" / "perf_plot.py")
    perf_plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_plot)
    for page in ("README.md", "docs/performance.md"):
        assert perf_plot.table() in TEXT[page], f"paste `python docs/perf_plot.py` into {page}"
