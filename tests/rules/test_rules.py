"""Rule parsing and validation: every mistake is a RuleError at the right place."""

import pytest
import sympy
import torch

import fuser

HYPER = dict(lr=0.1, beta=0.9)
STATE = dict(m=0.0)


def bad(text, **kw):
    with pytest.raises(fuser.RuleError) as info:
        fuser.rule(text, name="t", hyper=kw.pop("hyper", HYPER), state=kw.pop("state", STATE), **kw)
    return info.value


@pytest.mark.parametrize(
    "text, line, col, words",
    [
        ("p = p -", 1, None, "syntax error"),
        ("m = beta * m + g\np = p - lr * mm", 2, 14, "unknown name 'mm'"),
        ("p = p - lr * foo(g)", 1, 14, "unknown function 'foo'"),
        ("p = p - lr * g.sum()", 1, 14, "attribute access"),
        ("p = p - lr * g[0]", 1, 14, "subscripts"),
        ("p = p - (lambda: g)()", 1, 9, "only named functions"),
        ("import os\np = p", 1, 1, "imports"),
        ("from os import system\np = p", 1, 1, "imports"),
        ("g = 2 * g\np = p - g", 1, 1, "'g' is an input"),
        ("lr = 1\np = p - lr * g", 1, 1, "'lr' is an input"),
        ("step = 1\np = p", 1, 1, "'step' is an input"),
        ("m = beta * m", None, None, "never assigns p"),
        ("p = p - 1e999 * g", 1, 9, "not finite"),
        ("p = p - lr * g / 0", 1, 9, "non-finite"),
        ("p = p - lr * g % 2", 1, 9, "operator Mod"),
        ("p = p - lr * (g > 0)", 1, 15, "comparisons are only allowed"),
        ("x = step > 1 and g > 0\np = p - lr * x", 1, 5, "'and' and 'or' are only allowed in the condition"),
        ("p = p - lr * sqrt(g, g)", 1, 14, "takes 1 argument"),
        ("p = p - lr * sqrt(x=g)", 1, 14, "positional arguments"),
        ("p = p - 'x'", 1, 9, "not a number"),
        ("p = p - True", 1, 9, "not a number"),
        ("p, m = p, m", 1, 1, "one plain name"),
        ("if g > 0:\n    p = p", 1, 1, "if statements"),
        ("for i in g:\n    p = p", 1, 1, "loops"),
        ("p = [g][0]", 1, 5, "subscripts"),
        ("p = p + max([g])", 1, 9, "unknown function 'max'"),
        ("p = p - lr * sqrt", 1, 14, "is a function"),
        ("sqrt = g\np = p", 1, 1, "function name"),
        ("p = p - __import__('os').system('x')", 1, 9, "attribute access"),
        ("p = p - eval('1')", 1, 9, "unknown function 'eval'"),
        ("p = p - lr * g\nlr * g", 2, 1, "must assign"),
    ],
)
def test_rule_errors_name_line_column_and_cause(text, line, col, words):
    err = bad(text)
    assert words in err.message
    assert err.line == line
    if col is not None:
        assert err.col == col
    assert err.rule == "t"
    text_of_error = str(err)
    assert "rule 't'" in text_of_error
    if line is not None:
        # The offending line is quoted with a caret under the column.
        quoted, caret = text_of_error.splitlines()[1:3]
        assert quoted.strip() == text.splitlines()[line - 1].strip()
        if col is not None:
            assert caret.index("^") - 4 == col - 1


def test_rule_text_is_never_executed(tmp_path):
    marker = tmp_path / "ran"
    for text in [
        f"p = p - open({str(marker)!r}, 'w')",
        f"p = __import__('pathlib').Path({str(marker)!r}).touch()",
        "exec('x = 1')\np = p",
    ]:
        with pytest.raises(fuser.RuleError):
            fuser.rule(text, hyper={}, name="t")
    assert not marker.exists()


def test_bad_hyper_and_state_declarations():
    with pytest.raises(fuser.RuleError, match="finite number"):
        fuser.rule("p = p", hyper=dict(lr=float("nan")))
    with pytest.raises(fuser.RuleError, match="reserved"):
        fuser.rule("p = p", hyper=dict(g=1.0))
    with pytest.raises(fuser.RuleError, match="both a hyperparameter and a state"):
        fuser.rule("p = p", hyper=dict(m=1.0), state=dict(m=0.0))
    with pytest.raises(fuser.RuleError, match="start as a finite number or 'p'"):
        fuser.rule("p = p", hyper={}, state=dict(m="zeros"))
    with pytest.raises(fuser.RuleError, match="needs hyper"):
        fuser.rule("p = p")


def test_statements_run_in_order_and_outputs_are_final_values():
    r = fuser.rule(
        """
        m = beta * m + g
        p = p - lr * m
        m = 2 * m
    """,
        hyper=HYPER,
        state=STATE,
    )
    p, g, m, lr, beta = (fuser.rules.symbol(n) for n in ("p", "g", "m", "lr", "beta"))
    assert sympy.simplify(r.output("p") - (p - lr * (beta * m + g))) == 0
    assert sympy.simplify(r.output("m") - 2 * (beta * m + g)) == 0
    assert [s.target for s in r.statements] == ["m", "p", "m"]


def test_augmented_assignment_and_conditions():
    r = fuser.rule(
        """
        m += g
        p -= lr * where(g > 0 and m < 1, m, -m) if lr > 0 else p
    """,
        hyper=HYPER,
        state=STATE,
    )
    assert r.output("p").has(sympy.Piecewise)


def test_function_rule_traced_with_symbols():
    @fuser.rule(hyper=dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0), state=dict(m=0.0))
    def lion(p, g, m, *, lr, beta1, beta2, weight_decay, step):
        u = fuser.sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
        p = p * (1 - lr * weight_decay) - lr * u
        return dict(p=p, m=m)

    assert lion.name == "lion"
    p, g, m = (fuser.rules.symbol(n) for n in "pgm")
    lr, b1, b2, wd = (fuser.rules.symbol(n) for n in ("lr", "beta1", "beta2", "weight_decay"))
    want = p * (1 - lr * wd) - lr * sympy.sign(b1 * m + (1 - b1) * g)
    assert sympy.simplify(lion.output("p") - want) == 0
    assert sympy.simplify(lion.output("m") - (b2 * m + (1 - b2) * g)) == 0


def test_function_rule_errors():
    with pytest.raises(fuser.RuleError, match="not p, g or a state"):
        fuser.rule(lambda p, q: dict(p=p), hyper={})
    with pytest.raises(fuser.RuleError, match="neither a hyperparameter"):
        fuser.rule(lambda p, g, *, alpha: dict(p=p), hyper={})
    with pytest.raises(fuser.RuleError, match="must return a dict"):
        fuser.rule(lambda p, g: p - g, hyper={})
    with pytest.raises(fuser.RuleError, match="never assigns p"):
        fuser.rule(lambda p, g, m: dict(m=m), hyper={}, state=dict(m=0.0))
    with pytest.raises(fuser.RuleError, match="neither p nor a state"):
        fuser.rule(lambda p, g: dict(p=p, q=g), hyper={})

    def branchy(p, g, *, lr):
        if g > 0:  # a Python branch on a symbolic value cannot be traced
            return dict(p=p - lr)
        return dict(p=p)

    with pytest.raises(fuser.RuleError, match="tracing failed") as info:
        fuser.rule(branchy, hyper=dict(lr=1.0))
    assert info.value.line is not None

    import math

    with pytest.raises(fuser.RuleError, match="tracing failed"):
        fuser.rule(lambda p, g, *, lr: dict(p=p - lr * math.sqrt(g)), hyper=dict(lr=1.0))
    with pytest.raises(fuser.RuleError, match="not finite"):
        fuser.rule(lambda p, g: dict(p=p + sympy.oo), hyper={})


def test_unknown_compile_keywords_for_an_optimizer_rule_name_what_it_takes():
    rule = fuser.rule("m = beta * m + g\np = p - lr * m", name="t", hyper=HYPER, state=STATE)
    with pytest.raises(
        TypeError,
        match=r"unknown keywords \['max_matrix_dim'\].*state_dtype.*"
        r"max_matrix_dim is the optimizer's",
    ):
        fuser.compile(rule, max_matrix_dim=64)
    with pytest.raises(TypeError, match=r"\['lr', 'stat_dtype'\].*hyperparameters are the"):
        fuser.compile(rule, lr=0.1, stat_dtype="bf16")
    assert issubclass(fuser.compile(rule, state_dtype="bf16"), torch.optim.Optimizer)
