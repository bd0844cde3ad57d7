"""The README's snippets stay true: each block marked ``<!-- tested: exec -->`` runs as
written, and each marked ``<!-- tested: FILE#REGION -->`` is, word for word, the region of an
example file that its own test runs."""

import os
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"<!-- tested: (\S+) -->\n```python\n(.*?)```", re.S)
BLOCKS = BLOCK.findall(README)


def region(path: Path, name: str) -> str:
    text = path.read_text()
    pattern = rf"^[ \t]*# --8<-- \[start:{name}\]\n(.*?)^[ \t]*# --8<-- \[end:{name}\]\n"
    m = re.search(pattern, text, re.S | re.M)
    assert m, f"no region {name!r} in {path}"
    return textwrap.dedent(m.group(1))


def test_every_section_on_where_you_work_has_a_tested_snippet():
    part = README[README.index("## Where you already work"):]
    part = part[:part.index("\n## ", 1)]
    sections = re.split(r"\n### ", part)[1:]
    assert len(sections) >= 4
    for sec in sections:
        assert "<!-- tested: " in sec, f"section {sec.splitlines()[0]!r} has no tested snippet"


@pytest.mark.parametrize("target, code", [b for b in BLOCKS if b[0] != "exec"], ids=lambda v: v[:40])
def test_snippet_is_the_example_region(target, code):
    path, name = target.split("#")
    assert region(ROOT / path, name) == code


@pytest.mark.parametrize("code", [b[1] for b in BLOCKS if b[0] == "exec"],
                         ids=lambda c: c.splitlines()[2][:30])
def test_snippet_runs(code, tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(cwd)
    capsys.readouterr()
