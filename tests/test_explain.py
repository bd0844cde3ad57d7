"""`fuser.explain` and the notebook displays: rules as LaTeX, optimizers as highlighted
kernel source (found by IPython's own formatter, for classes and instances), RuleError
shown as one message with a caret."""

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sympy
import torch
from childenv import child_env

import fuser
from fuser.cache import entry_key
from fuser.losses import CROSS_ENTROPY, SOFTCAP_CROSS_ENTROPY
from fuser.optim import kernel_sources
from fuser.optim.builtins import adamw as builtin_adamw

ROOT = Path(__file__).resolve().parent.parent


def _formatter():
    """IPython's own display formatter (the notebook displays' tests skip without IPython)."""
    return pytest.importorskip("IPython.core.formatters").DisplayFormatter()


ADAMW = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
""",
    name="adamw_rule",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
    state=dict(m=0.0, v=0.0),
)


def explained(obj, *args, **kw) -> str:
    buf = io.StringIO()
    assert fuser.explain(obj, *args, file=buf, **kw) is None
    return buf.getvalue()


def section(text: str, number: int) -> str:
    start = text.index(f"\n{number}. ")
    end = text.find(f"\n{number + 1}. ", start)
    return text[start : end if end >= 0 else None]


def test_explain_prints_every_stage_in_order():
    text = explained(ADAMW)
    heads = [
        "1. parsed statements",
        "2. per-step scalars",
        "3. per-element plan after CSE",
        "4. phases and reductions",
        "5. dtype plan",
        "6. kernels and cache keys",
    ]
    positions = [text.index(h) for h in heads]
    assert positions == sorted(positions)
    assert text.startswith("fuser.explain: optimizer rule 'adamw_rule', fp32")


def test_explain_statements_are_as_written_and_outputs_substituted():
    text = explained(builtin_adamw)
    parsed = section(text, 1)
    # The second line reads `d`, as written; the output for exp_avg has `d` substituted.
    assert "line 2: exp_avg = beta1*exp_avg + d*(1 - beta1)" in parsed
    outputs = parsed[parsed.index("outputs") :]
    assert re.search(r"exp_avg <- .*maximize", outputs)
    assert not re.search(r"\bd\b", outputs)


def test_explain_shows_hoisting_and_cse():
    text = explained(ADAMW)
    scalars, body = section(text, 2), section(text, 3)
    # Bias corrections are per-step scalars; no per-element line mentions `step`.
    assert "beta1**step" in scalars and "beta2**step" in scalars
    assert "step" not in body.replace("per-step", "")
    # CSE: the new moments are computed once, as temporaries, and stored from them.
    assert re.search(r"^\s+t0 = ", body, re.M)
    assert re.search(r"^\s+store m = t\d$", body, re.M)
    assert re.search(r"^\s+store v = t\d$", body, re.M)


def test_explain_dtype_plan_and_cache_key_match_what_runs():
    text = explained(ADAMW, "bf16", state_dtype=torch.bfloat16)
    plan = section(text, 5)
    assert re.search(r"^\s+p\s+param\s+bf16\s+read/write$", plan, re.M)
    assert re.search(r"^\s+g\s+grad\s+bf16\s+read$", plan, re.M)
    assert re.search(r"^\s+m\s+state\s+bf16\s+read/write$", plan, re.M)
    assert "lr, beta1, beta2, eps, weight_decay" in plan
    (source,) = kernel_sources(ADAMW, "bf16", state_dtype=torch.bfloat16)
    assert f"cache key {entry_key(source).digest}" in text
    assert entry_key(kernel_sources(ADAMW, "fp32")[0]).digest not in text


def test_explain_shows_phases_and_reductions():
    from fuser.optim.builtins import lamb

    text = explained(lamb)
    parsed, body, phases = section(text, 1), section(text, 3), section(text, 4)
    # Rule spelling, not sympy's: norm(...) and where(...), not Norm(...) and Piecewise(...).
    assert "p_norm = norm(p)" in parsed and "trust = where(p_norm > 0, " in parsed
    assert "Norm" not in text and "Piecewise" not in text
    # Phase 0 accumulates both norms (as sums of squares) and stores the moments it
    # computes; phase 1 stores the parameter.
    phase0, phase1 = body.split("phase 1:")
    assert re.search(r"accumulate r\d \+= p\*\*2$", phase0, re.M)
    assert len(re.findall(r"accumulate r\d", phase0)) == 2
    assert re.findall(r"store (\w+) = ", phase0) == ["exp_avg", "exp_avg_sq"]
    assert re.findall(r"store (\w+) = ", phase1) == ["p"] and "accumulate" not in phase1
    assert len(re.findall(r"norm\(\.\.\.\) per tensor: accumulated in phase 0", phases)) == 2
    assert "phases: 2 launches per step" in phases
    assert "stored by the phase that computes them: exp_avg in phase 0, exp_avg_sq in phase 0" in phases
    sources = kernel_sources(lamb)
    assert len(sources) == 2
    for src in sources:
        assert f"{src.entry}(" in text and f"cache key {entry_key(src).digest}" in text


def test_explain_takes_compiled_optimizers_with_their_options():
    cls = fuser.compile(ADAMW, state_dtype="param")
    assert explained(cls, "fp16") == explained(ADAMW, "fp16", state_dtype="param")
    opt = cls([torch.nn.Parameter(torch.randn(3))])
    assert explained(opt) == explained(ADAMW, state_dtype="param")
    assert "state  fp16" in explained(cls, "fp16")


def test_cache_key_is_the_one_the_cache_stores(tmp_path):
    """After one step the kernel is in the cache under the key explain printed, and
    `fuser cache explain KEY` finds it."""
    cls = fuser.compile(ADAMW)
    key = re.search(r"cache key ([0-9a-f]{64})", explained(cls)).group(1)
    env = child_env(cache=tmp_path)
    step = (
        "import torch, fuser; from tests.test_explain import ADAMW; "
        "p = torch.nn.Parameter(torch.randn(9)); p.grad = torch.randn(9); "
        "fuser.compile(ADAMW)([p]).step()"
    )
    subprocess.run([sys.executable, "-c", step], env=env, cwd=ROOT, check=True, timeout=300)
    shown = subprocess.run(
        [sys.executable, "-m", "fuser", "cache", "explain", key[:12]],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"entry {key}" in shown.stdout and "rule adamw_rule" in shown.stdout


def test_explain_rejects_other_objects():
    with pytest.raises(TypeError, match="fuser.Rule or a compiled optimizer"):
        fuser.explain("m = g")
    with pytest.raises(ValueError, match="dtype"):
        fuser.explain(ADAMW, "fp64")


def test_traced_rule_explained_from_its_function():
    @fuser.rule(hyper=dict(lr=1e-4, beta1=0.9, beta2=0.99), state=dict(m=0.0))
    def lion(p, g, m, *, lr, beta1, beta2, step):
        u = fuser.sign(beta1 * m + (1 - beta1) * g)
        return dict(p=p - lr * u, m=beta2 * m + (1 - beta2) * g)

    text = explained(lion)
    assert "traced from a Python function" in text
    assert "def lion(p, g, m, *, lr, beta1, beta2, step):" in text
    assert "m <- " in text


# LaTeX -------------------------------------------------------------------------------
def latex_rows(rule) -> list[str]:
    tex = _formatter().format(rule)[0]["text/latex"]
    assert tex.startswith("$$\\begin{aligned}") and tex.endswith("\\end{aligned}$$")
    assert tex.count("{") == tex.count("}")
    body = tex[len("$$\\begin{aligned}") : -len("\\end{aligned}$$")]
    return [r.strip() for r in body.split("\\\\\n")]


def test_rule_latex_is_statement_by_statement_as_written():
    rows = latex_rows(builtin_adamw)
    assert [r.split("&")[0].strip() for r in rows] == [
        "d",
        "\\mathit{exp\\_avg}",
        "\\mathit{exp\\_avg\\_sq}",
        "p",
        "p",
    ]
    assert all("&\\leftarrow" in r for r in rows)
    # `exp_avg` reads d as written; `maximize` appears only where d is defined.
    assert "d" in rows[1] and "maximize" not in rows[1]
    assert "\\beta_{1}" in rows[1]
    assert "\\epsilon" in rows[4] and "\\mathit{lr}" in rows[4]


def test_rule_latex_names_fuser_functions():
    r = fuser.rule(
        """
        u = where(g > 0, sigmoid(g), log1p(g * g)) + expm1(g) + clamp(g, -1, 1) + sign(g)
        p = p - lr * u
    """,
        hyper=dict(lr=0.1),
    )
    row = latex_rows(r)[0]
    for name in (
        "\\sigma",
        "\\operatorname{log1p}",
        "\\operatorname{expm1}",
        "\\operatorname{sign}",
        "\\begin{cases}",
        "\\min",
        "\\max",
    ):
        assert name in row


def test_traced_rule_latex_primes_its_outputs():
    @fuser.rule(hyper=dict(lr=0.1, beta=0.9), state=dict(m=0.0))
    def momentum(p, g, m, *, lr, beta):
        m = beta * m + g
        return dict(m=m, p=p - lr * m)

    rows = latex_rows(momentum)
    # Each output is written from the values before the step: p' reads the old m.
    assert rows[0].startswith("m' &= ") and rows[1].startswith("p' &= ")
    assert "\\beta" in rows[1]


# HTML --------------------------------------------------------------------------------
def html_of(obj) -> str:
    data = _formatter().format(obj)[0]
    assert "text/html" in data, f"IPython finds no HTML for {obj!r}"
    return data["text/html"]


def test_compiled_class_shows_highlighted_source():
    cls = fuser.compile(ADAMW)
    page = html_of(cls)
    assert "AdamwRule" in page and "adamw_rule_step" in page
    assert "<td>weight_decay</td><td>0.01</td>" in page
    assert 'style="color:' in page  # pygments with inline styles
    text = re.sub(r"<[^>]+>", "", page)
    import html as html_lib

    text = html_lib.unescape(text)
    for line in cls.source.splitlines():
        if line.strip():
            assert line.strip() in text


def test_instance_shows_groups_and_launched_kernels():
    cls = fuser.compile(ADAMW)
    w = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    opt = cls([{"params": [w]}, {"params": [b], "lr": 3e-3}], lr=1e-2)
    before = html_of(opt)
    assert "<tr><td>0</td><td>1</td><td>0.01</td>" in before
    assert "<tr><td>1</td><td>1</td><td>0.003</td>" in before
    assert "Triton kernel adamw_rule_step for p:fp32-g:fp32-m:fp32-v:fp32" in before
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    after = html_of(opt)
    # One kernel per dtype plan that ran: the bf16 one is shown beside the fp32 one.
    assert "p:fp32-g:fp32" in after and "p:bf16-g:bf16" in after


def test_multi_phase_optimizer_shows_every_kernel():
    page = html_of(fuser.optim.LAMB)
    assert "Triton kernel lamb_phase0 for " in page and "Triton kernel lamb_phase1 for " in page


def test_html_falls_back_to_escaped_pre_without_pygments(monkeypatch):
    # IPython imports pygments itself: hidden before IPython's first import, it would leave a
    # half-imported IPython in sys.modules and fail every later display test of the worker.
    formatter = _formatter()
    compiled = fuser.compile(ADAMW)
    monkeypatch.setitem(sys.modules, "pygments", None)
    page = formatter.format(compiled)[0]["text/html"]
    assert "<pre>" in page and 'style="color:' not in page
    assert "offs &lt; n" in page and "offs < n" not in page


# RuleError in a notebook -------------------------------------------------------------
def test_rule_error_renders_as_one_message_with_a_caret():
    with pytest.raises(fuser.RuleError) as info:
        fuser.rule(
            """
            m = beta1 * m + (1 - beta1) * g
            p = p - lr * m / (sqrt(m**2) + epsilon)
        """,
            name="typo",
            hyper=dict(lr=1e-3, beta1=0.9, eps=1e-8),
            state=dict(m=0.0),
        )
    lines = info.value._render_traceback_()
    assert lines[0].startswith("RuleError: rule 'typo', line 2, column 32: unknown name 'epsilon'")
    assert len(lines) == 3
    assert lines[2].index("^") == lines[1].index("epsilon")


# Loss rules -------------------------------------------------------------------------------
def test_loss_rule_latex_shows_statements_and_the_derived_gradient():
    rows = latex_rows(SOFTCAP_CROSS_ENTROPY)
    heads = [r.split("&")[0].strip() for r in rows]
    assert heads[:4] == ["z", "z", "\\mathit{lse}", "\\mathit{loss}"]
    assert "z_{y}" in rows[3] and "\\operatorname{mean}\\left(z\\right)" in rows[3]
    grad = rows[4]
    assert grad.startswith("\\frac{\\partial\\,\\mathit{loss}}{\\partial z} &= ")
    assert "[z{=}z_{y}]" in grad and "r_{0}" in grad and "\\tanh" in grad
    assert rows[5].startswith("r_{0} &= \\operatorname{logsumexp}_z")
    assert rows[6].startswith("r_{1} &= \\operatorname{sum}_z")


def test_explain_loss_shows_the_real_derivative():
    text = explained(CROSS_ENTROPY)
    for head in (
        "1. parsed statements",
        "2. reductions over the vocabulary",
        "3. derived gradient",
        "4. plan after the reductions",
        "5. dtype plan",
        "6. kernel and cache key",
    ):
        assert head in text
    written = re.search(r"line 1: loss = (.*)$", text, re.M).group(1)
    assert sorted(written.replace(" ", "").replace("+", " ").split()) == ["-z[y]", "logsumexp(z)"]
    assert re.search(r"r0 = logsumexp\(z\)$", text, re.M)
    # Read the printed derivative back: softmax minus the target's indicator.
    line = re.search(r"^   dloss/dz: (.*)$", text, re.M).group(1)
    z, r0, is_y = sympy.symbols("z r0 is_y")
    printed = sympy.sympify(line, locals={"z": z, "r0": r0, "is_y": is_y})
    assert sympy.simplify(printed - (sympy.exp(z - r0) - is_y)) == 0
    assert "bf16 hidden states and weight, fp32 logits" in text
    # (the kernel shown is the one calls of every dtype launch: the row kernel on fp32 logits)
    assert f"cache key {entry_key(fuser.compile(CROSS_ENTROPY).row_source()).digest}" in text


def test_explain_compiled_loss_uses_its_kernel():
    compiled = fuser.compile(SOFTCAP_CROSS_ENTROPY, block=256)
    text = explained(compiled, "fp32")
    src = compiled.kernel_source("fp32")
    assert dict(src.constexprs)["BLOCK"] == 256 and "BLOCK=256" in text
    assert f"cache key {entry_key(src).digest}" in text


def test_compiled_loss_shows_its_kernel():
    compiled = fuser.compile(SOFTCAP_CROSS_ENTROPY)
    page = html_of(compiled)
    assert "<td>softcap</td><td>30.0</td>" in page
    assert compiled.kernel_source("bf16").entry in page and 'style="color:' in page


def test_matrix_rule_explains_the_update_kernels_buffers_as_buffers():
    rule = fuser.rule(
        "m = beta * m + g\nL = L + g @ transpose(g)\np = p - lr * (L @ m)",
        name="left",
        hyper=dict(lr=0.1, beta=0.9),
        state=dict(m=0.0, L="zeros(rows, rows)"),
    )
    buf = io.StringIO()
    fuser.explain(rule, file=buf)
    text = buf.getvalue()
    kernel = text[text.index("3. the update kernel") :]
    assert "   state (initial values): m=0.0\n" in kernel
    assert "buffers from the matrix phase (fp32, read): matrix_value0" in kernel
    assert re.search(r"matrix_value0 +buffer +fp32 +read\n", kernel)
