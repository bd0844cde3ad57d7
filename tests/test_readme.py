"""The README's snippets stay true: each block marked ``<!-- tested: exec -->`` runs as
written (``sh`` blocks in bash, from a folder beside the examples), and each marked
``<!-- tested: FILE#REGION -->`` is, word for word, the region of an example file that its
own test runs."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"<!-- tested: (\S+) -->\n```(python|sh)\n(.*?)```", re.S)
BLOCKS = [(target, code) for target, lang, code in BLOCK.findall(README) if lang == "python"]
SHELL = [code for target, lang, code in BLOCK.findall(README) if lang == "sh" and target == "sh"]


def region(path: Path, name: str) -> str:
    text = path.read_text()
    pattern = rf"^[ \t]*# --8<-- \[start:{name}\]\n(.*?)^[ \t]*# --8<-- \[end:{name}\]\n"
    m = re.search(pattern, text, re.S | re.M)
    assert m, f"no region {name!r} in {path}"
    return textwrap.dedent(m.group(1))


def test_every_section_on_where_you_work_has_a_tested_snippet():
    part = README[README.index("## Where you already work") :]
    part = part[: part.index("\n## ", 1)]
    sections = re.split(r"\n### ", part)[1:]
    assert len(sections) >= 5
    for sec in sections:
        assert "<!-- tested: " in sec, f"section {sec.splitlines()[0]!r} has no tested snippet"


@pytest.mark.parametrize("target, code", [b for b in BLOCKS if b[0] != "exec"], ids=lambda v: v[:40])
def test_snippet_is_the_example_region(target, code):
    path, name = target.split("#")
    assert region(ROOT / path, name) == code


@pytest.mark.parametrize(
    "code", [b[1] for b in BLOCKS if b[0] == "exec"], ids=lambda c: c.splitlines()[2][:30]
)
def test_snippet_runs(code, tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(cwd)
    capsys.readouterr()


@pytest.mark.parametrize("code", SHELL, ids=lambda c: c.splitlines()[0][:30])
def test_shell_snippet_runs(code, tmp_path):
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
