"""Loss rules: checks with RuleError, the traced form, the derived gradient, rendering."""

import hashlib
import os
import subprocess
import sys

import pytest
import sympy
from childenv import child_env

import fuser
import fuser.losses
from fuser.codegen.loss import render_loss
from fuser.ir.loss import IS_Y, Z_Y, Z, lower_loss, reduction_symbol

SOFTCAP = """
    z = cap * tanh(z / cap)
    lse = logsumexp(z)
    loss = lse - z[y] + z_loss * lse**2
"""


def softcap_rule():
    return fuser.loss(SOFTCAP, name="softcap_ce_zloss", hyper=dict(cap=30.0, z_loss=1e-4))


@pytest.mark.parametrize(
    "text, line, col, message",
    [
        ("lse = logsumexp(z)", 1, None, "never assigns loss"),
        ("loss = logsumexp(z) - z", 1, 1, "z outside a reduction"),
        ("loss = logsumexp(z) - y", 1, 1, "target index"),
        ("loss = logsumexp(z) - z[y]\nloss = loss + sum(z_loss)", 2, 1, "does not depend on z"),
        ("loss = logsumexp(z) - z[0]", 1, 23, r"subscripts are not allowed except z\[y\]"),
        ("loss = logsumexp(z) - z[y] + norm(z)", 1, 30, "unknown function 'norm'"),
        ("y = 3\nloss = z[y]", 1, 1, "input of the rule"),
        ("loss = logsumexp(z, 2) - z[y]", 1, 8, "takes 1 argument"),
        ("loss = __import__('os')", 1, 8, "unknown function"),
        ("loss = logsumexp(z) - z[y] +", 1, None, "syntax error"),
        ("loss = z_los * logsumexp(z)", 1, 8, "unknown name 'z_los'"),
    ],
)
def test_rule_errors_name_line_and_column(text, line, col, message):
    with pytest.raises(fuser.RuleError, match=message) as err:
        fuser.loss(text, name="bad", hyper=dict(z_loss=1e-4))
    assert err.value.line == line
    if col is not None:
        assert err.value.col == col
    assert "rule 'bad'" in str(err.value)


def test_hyperparameter_names_are_checked():
    with pytest.raises(fuser.RuleError, match="reserved"):
        fuser.loss("loss = logsumexp(z) - z[y]", hyper=dict(z=1.0))
    with pytest.raises(fuser.RuleError, match="finite"):
        fuser.loss("loss = logsumexp(z) - z[y]", hyper=dict(tau=float("inf")))


def test_traced_function_errors():
    with pytest.raises(fuser.RuleError, match="neither z nor y"):
        fuser.loss(lambda z, w: z, name="bad")
    with pytest.raises(fuser.RuleError, match="z itself"):
        fuser.loss(lambda z, y: z * 2, name="bad")

    def uses_if(z, y):
        if z > 0:
            return z[y]
        return z[y]

    with pytest.raises(fuser.RuleError, match="tracing failed"):
        fuser.loss(uses_if, name="bad")


def test_traced_function_builds_the_text_rule():
    @fuser.loss(hyper=dict(cap=30.0, z_loss=1e-4))
    def softcap_ce_zloss(z, y, *, cap, z_loss):
        z = cap * fuser.tanh(z / cap)
        lse = fuser.losses.logsumexp(z)
        return lse - z[y] + z_loss * lse**2

    assert softcap_ce_zloss.kind == "loss" and softcap_ce_zloss.name == "softcap_ce_zloss"
    assert sympy.simplify(softcap_ce_zloss.output("loss") - softcap_rule().output("loss")) == 0


def test_z_index_means_the_transformed_logit_but_not_inside_reductions():
    rule = fuser.loss("z = z - logsumexp(z)\nloss = -z[y]", name="logsoftmax")
    lse = fuser.rules.functions.LogSumExp(Z)
    assert rule.output("loss") == lse - Z_Y


def test_cross_entropy_gradient_is_softmax_minus_indicator():
    plan = lower_loss(fuser.losses.CROSS_ENTROPY)
    derived = dict(plan.derivation)["dloss/dz"]
    r0 = reduction_symbol(0)
    assert sympy.simplify(derived - (sympy.exp(Z - r0) - IS_Y)) == 0
    assert len(plan.passes) == 1


def test_entropy_needs_two_sweeps_and_no_extra_reduction():
    plan = lower_loss(fuser.losses.ENTROPY_REGULARIZED_CROSS_ENTROPY)
    assert [len(p.accumulators) for p in plan.passes] == [1, 1]
    assert [a.op for a in plan.reductions] == ["logsumexp", "sum"]


def test_rendering_is_deterministic_and_quotes_the_rule():
    a = render_loss(lower_loss(softcap_rule(), "bf16"))
    b = render_loss(lower_loss(softcap_rule(), "bf16"))
    assert a.text == b.text and a.digest == b.digest
    assert render_loss(lower_loss(softcap_rule(), "fp32")).digest != a.digest
    head = a.text.splitlines()[:8]
    assert head[0].startswith("# fuser loss epilogue `softcap_ce_zloss`")
    assert "#   z = cap * tanh(z / cap)" in head and "#   loss = lse - z[y] + z_loss * lse**2" in head


def test_rendering_is_byte_identical_across_processes(sweep):
    # a quarter of the built-in rules a run, all in 4 runs (tests/README.md, sweeps): each
    # renders from scratch in the child (sympy lowers a softcap rule in ~15 s)
    names = sweep(sorted(r.name for r in fuser.losses.builtins.RULES), 4)
    code = (
        "import hashlib, fuser, fuser.losses\n"
        f"for r in [r for r in fuser.losses.builtins.RULES if r.name in {names!r}]:\n"
        "    for s in fuser.losses.kernel_sources(r, 'bf16'):\n"
        "        print(hashlib.sha256(s.text.encode()).hexdigest())\n"
    )
    # one child under a hash seed other than this process's (sets and dicts iterate otherwise)
    seed = "0" if os.environ.get("PYTHONHASHSEED") == "4242" else "4242"
    env = child_env(PYTHONHASHSEED=seed)
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
    }
    here = "".join(
        hashlib.sha256(s.text.encode()).hexdigest() + "\n"
        for r in fuser.losses.builtins.RULES
        if r.name in names
        for s in fuser.losses.kernel_sources(r, "bf16")
    )
    outs.add(here)
    assert len(outs) == 1


def test_compiled_loss_exposes_its_source():
    f = fuser.compile(softcap_rule())
    assert "softcap_ce_zloss_loss_rows" in f.source
    assert f.kernel_source("fp16").signature[0] == ("logits", "*fp16")
