"""examples/quickstart.ipynb, executed top to bottom in a Jupyter kernel as a new user would
run it (CPU tensors through Triton's interpreter), and checked cell by cell."""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def execute():
    """The notebook's code cells after it ran in a Jupyter kernel."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ)
    # The kernel imports fuser from this checkout, as from an editable install.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    # Any cell that raises, except the one tagged raises-exception, fails the test.
    client.execute(env=env)
    return [c for c in nb.cells if c.cell_type == "code"]


def cell_with(cells, text):
    found = [c for c in cells if text in c.source]
    assert len(found) == 1, text
    return found[0]


def output_data(cell, mime):
    for out in cell.outputs:
        if out.output_type in ("execute_result", "display_data") and mime in out.data:
            return out.data[mime]
    raise AssertionError(f"no {mime} output in cell {cell.source[:60]!r}")


def stdout(cell):
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def every_cell_ran(executed):
    assert all(c.execution_count is not None for c in executed)
    errors = [c for c in executed if any(o.output_type == "error" for o in c.outputs)]
    assert [c.metadata.get("tags") for c in errors] == [["raises-exception"]]


def rule_cell_shows_math(executed):
    tex = output_data(cell_with(executed, 'name="adabelief"'), "text/latex")
    assert tex.startswith("$$\\begin{aligned}")
    assert len(re.findall(r"&\\leftarrow", tex)) == 3
    assert "\\beta_{2} s" in tex


def explain_cell_prints_each_stage(executed):
    text = stdout(cell_with(executed, "fuser.explain(adabelief)"))
    for head in (
        "parsed statements",
        "per-step scalars",
        "per-element plan after CSE",
        "phases and reductions",
        "dtype plan",
        "cache key",
    ):
        assert head in text


def error_cell_is_one_rule_error_with_a_caret(executed):
    cell = cell_with(executed, 'name="typo"')
    (err,) = [o for o in cell.outputs if o.output_type == "error"]
    assert err.ename == "RuleError"
    lines = "\n".join(err.traceback).splitlines()
    assert lines[0].startswith("RuleError: rule 'typo', line 2, column 32: unknown name 'epsilon'")
    assert len(lines) == 3, "a traceback through fuser's parser was shown"
    assert lines[2].index("^") == lines[1].index("epsilon")


def compiled_optimizer_shows_its_kernel(executed):
    page = output_data(cell_with(executed, "AdaBelief = fuser.compile(adabelief)"), "text/html")
    assert "adabelief_step" in page and 'style="color:' in page


def training_compares_with_torch(executed):
    text = stdout(cell_with(executed, "ours = train("))
    rows = re.findall(r"step\s+(\d+)\s+AdaBelief \(fuser\) ([\d.]+)\s+AdamW \(torch\) ([\d.]+)", text)
    assert [r[0] for r in rows] == ["1", "10", "20", "30", "40"]
    assert rows[0][1] == rows[0][2]  # same model, same first loss
    assert float(rows[-1][1]) < float(rows[0][1]) / 2
    diff = stdout(cell_with(executed, "largest parameter difference"))
    assert float(diff.split(":")[-1]) < 1e-5


def instance_cell_shows_groups(executed):
    page = output_data(cell_with(executed, "opt = AdaBelief([{"), "text/html")
    assert "<th>group</th>" in page and "<td>0.003</td>" in page


def loss_rule_cell_shows_math_and_derived_gradient(executed):
    tex = output_data(cell_with(executed, 'name="softcap_ce_zloss"'), "text/latex")
    assert "\\frac{\\partial\\,\\mathit{loss}}{\\partial z} &= " in tex
    assert "r_{0} &= \\operatorname{logsumexp}_z" in tex


def loss_explain_and_kernel(executed):
    text = stdout(cell_with(executed, "fuser.explain(softcap_ce)"))
    assert "loss rule 'softcap_ce_zloss'" in text and "dloss/dz:" in text and "cache key" in text
    page = output_data(cell_with(executed, "head_loss = fuser.compile(softcap_ce)"), "text/html")
    assert "softcap_ce_zloss" in page and 'style="color:' in page


def fused_loss_matches_torch_and_trains(executed):
    text = stdout(cell_with(executed, "torch_softcap_ce(h, w, target)"))
    fused, ref = map(float, re.search(r"loss: fuser ([\d.]+)\s+torch ([\d.]+)", text).groups())
    assert abs(fused - ref) < 1e-5 * ref
    printed = stdout(cell_with(executed, "lm_head"))
    steps = [float(v) for v in re.findall(r"step\s+\d+\s+loss ([\d.]+)", printed)]
    assert len(steps) == 5 and steps[-1] < steps[0] / 10


CHECKS = [
    every_cell_ran,
    rule_cell_shows_math,
    explain_cell_prints_each_stage,
    error_cell_is_one_rule_error_with_a_caret,
    compiled_optimizer_shows_its_kernel,
    training_compares_with_torch,
    instance_cell_shows_groups,
    loss_rule_cell_shows_math_and_derived_gradient,
    loss_explain_and_kernel,
    fused_loss_matches_torch_and_trains,
]


def test_notebook_runs_and_each_cell_shows_what_it_should():
    # One test, so that a parallel run executes the notebook once (about 20 s of one core);
    # every check runs, and the failure lists each one that failed.
    cells = execute()
    failures = []
    for check in CHECKS:
        try:
            check(cells)
        except AssertionError as e:
            failures.append(f"{check.__name__}: {e}")
    assert not failures, "\n".join(failures)
