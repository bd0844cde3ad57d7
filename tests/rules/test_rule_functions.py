"""The rule language's trigonometric, remainder, step-gate and random functions, the
constant pi and the loss input: what they build, and a RuleError at the right place for
every misuse."""

import pytest
import sympy

import fuser
from fuser.display import expr_text, rule_latex
from fuser.rules.functions import Rand, Randn, RandomValue, Remainder
from fuser.rules.rule import reads_loss

HYPER = dict(lr=0.1, k=4.0)


def bad(text, **kw):
    with pytest.raises(fuser.RuleError) as info:
        fuser.rule(text, name="t", hyper=kw.pop("hyper", HYPER), state=kw.pop("state", {}), **kw)
    return info.value


@pytest.mark.parametrize(
    "text, line, col, words",
    [
        ("p = p - lr * cos(g, p)", 1, 14, "cos() takes 1 argument, got 2"),
        ("p = p - lr * sin()", 1, 14, "sin() takes 1 argument, got 0"),
        ("u = g\np = p - lr * mod(g)", 2, 14, "mod() takes 2 arguments, got 1"),
        ("p = p - lr * mod(g, 0)", 1, 14, "b = 0"),
        ("p = p - lr * mod(g, 1 - 1)", 1, 14, "b = 0"),
        ("p = where(every(k, 2), p - lr * g, p)", 1, 11, "every() takes 1 argument, got 2"),
        ("p = where(every(0), p - lr * g, p)", 1, 11, "k > 0"),
        ("p = where(every(-2), p - lr * g, p)", 1, 11, "k > 0"),
        ("p = where(every(g), p - lr * g, p)", 1, 17, "hyperparameters and step"),
        ("p = where(every(norm(p)), p - lr * g, p)", 1, 17, "hyperparameters and step"),
        ("u = every(k)\np = p - lr * u", 1, 5, "every() is a condition"),
        ("p = p - lr * every(k) * g", 1, 14, "every() is a condition"),
        ("cos = g\np = p - lr * cos", 1, 1, "'cos' is a function name"),
        ("p = p - lr * mod * g", 1, 14, "'mod' is a function"),
        ("p = p - lr * rand(3) * g", 1, 14, "rand() takes 0 arguments, got 1"),
        ("u = g\np = p - lr * randn(g, g)", 2, 14, "randn() takes 0 arguments, got 2"),
        ("p = p - lr * randn * g", 1, 14, "'randn' is a function"),
        ("p = p - lr * (g % 2)", 1, 15, "a remainder is mod(a, b)"),
        ("p = p - lr * (g // 2)", 1, 15, "a remainder is mod(a, b)"),
    ],
)
def test_misuse_is_a_rule_error_at_its_line_and_column(text, line, col, words):
    err = bad(text)
    assert words in str(err)
    assert (err.line, err.col) == (line, col)


def test_function_names_are_reserved_for_hyperparameters_and_states():
    for name in ("cos", "sin", "mod", "every", "rand", "randn"):
        with pytest.raises(fuser.RuleError, match="reserved"):
            fuser.rule("p = p - lr * g", hyper=dict(lr=0.1, **{name: 1.0}))


def test_pi_is_a_constant_unless_the_rule_names_it():
    r = fuser.rule("p = p - lr * cos(pi * step / k) * g", hyper=HYPER)
    assert r.output("p").has(sympy.pi)
    own = fuser.rule("p = p - lr * pi * g", hyper=dict(lr=0.1, pi=3.0))
    assert not own.output("p").has(sympy.pi) and sympy.Symbol("pi", real=True) in own.output("p").free_symbols


def test_mod_has_pythons_sign_convention_on_numbers():
    # numbers fold when the rule is made, as Python's % computes them
    for a, b in ((-1, 3), (1, -3), (5.5, 2), (-5.5, 2), (7, 7)):
        assert float(Remainder(sympy.sympify(a), sympy.sympify(b))) == pytest.approx(a % b)


def test_every_is_mod_of_step_equal_to_zero_and_reads_as_written():
    r = fuser.rule("p = where(every(k) and g > 0, p - lr * g, p)", hyper=HYPER)
    (_, cond), _ = r.output("p").args
    step, k = sympy.Symbol("step", real=True), sympy.Symbol("k", real=True)
    assert sympy.Eq(Remainder(step, k), 0) in cond.args
    assert "mod(step, k)" in expr_text(r.output("p"))
    latex = rule_latex(r)
    assert r"\operatorname{mod}" in latex and "k" in latex


def test_traced_rule_calls_the_same_functions():
    @fuser.rule(hyper=HYPER)
    def traced(p, g, *, lr, k, step):
        lr_t = lr * 0.5 * (1 + fuser.cos(fuser.pi * step / k))
        return dict(p=fuser.where(fuser.every(k), p - lr_t * fuser.sin(g) + fuser.mod(g, 2), p))

    text = fuser.rule(
        "p = where(every(k), p - lr * 0.5 * (1 + cos(pi * step / k)) * sin(g) + mod(g, 2), p)", hyper=HYPER
    )
    assert sympy.simplify(traced.output("p") - text.output("p")) == 0


def test_traced_mod_by_zero_is_a_rule_error():
    with pytest.raises(fuser.RuleError, match="b = 0"):

        @fuser.rule(hyper=HYPER)
        def traced(p, g, *, lr):
            return dict(p=p - lr * fuser.mod(g, 0))


def test_traced_python_comparisons_are_refused_and_sympy_ones_gate():
    # (sympy's == compares two expressions as written: a Python False, a gate never open)
    with pytest.raises(fuser.RuleError, match=r"Python bool False.*sympy.Eq\(a, b\)"):

        @fuser.rule(hyper=HYPER)
        def equal(p, g, *, lr, step):
            return dict(p=fuser.where(fuser.mod(step, 2) == 0, p - lr * g, p))

    @fuser.rule(hyper=HYPER)
    def gated(p, g, *, lr, step):
        return dict(p=fuser.where(sympy.Eq(fuser.mod(step, 2), 0) & (g > 0), p - lr * g, p))

    text = fuser.rule("p = where(mod(step, 2) == 0 and g > 0, p - lr * g, p)", hyper=HYPER)
    assert gated.output("p") == text.output("p")


def test_draws_are_numbered_in_call_order_and_one_name_is_one_draw():
    r = fuser.rule(
        "u = randn()\nm = u * rand() + u\np = p - lr * (rand() - m) * g", hyper=HYPER, state=dict(m=0.0)
    )
    draws = sorted(r.output("p").atoms(RandomValue), key=lambda d: d.index)
    assert [(type(d), d.index) for d in draws] == [(Randn, 0), (Rand, 1), (Rand, 2)]
    again = fuser.rule(
        "u = randn()\nm = u * rand() + u\np = p - lr * (rand() - m) * g", hyper=HYPER, state=dict(m=0.0)
    )
    assert r.output("p") == again.output("p")  # the same text, the same draws
    assert expr_text(r.output("m")) in ("randn()*rand() + randn()", "rand()*randn() + randn()")
    assert r"\operatorname{rand}()" in rule_latex(r)

    @fuser.rule(hyper=HYPER)
    def traced(p, g, *, lr):
        u = fuser.rand()
        return dict(p=p - lr * (u - fuser.rand()) * u * g)

    assert sorted(d.index for d in traced.output("p").atoms(RandomValue)) == [0, 1]


def test_loss_rules_have_no_draws_or_step_gate():
    for text in ("loss = logsumexp(z) - z[y] + rand()", "loss = where(every(2), logsumexp(z) - z[y], 0)"):
        with pytest.raises(fuser.RuleError, match="unknown function"):
            fuser.loss(text)


def test_loss_is_a_per_step_input_of_text_and_traced_rules():
    text = fuser.rule("p = where(every(k), p - lr * loss * g, p)", hyper=HYPER)

    @fuser.rule(hyper=HYPER)
    def traced(p, g, *, lr, k, loss):
        return dict(p=fuser.where(fuser.every(k), p - lr * loss * g, p))

    assert sympy.simplify(traced.output("p") - text.output("p")) == 0
    assert reads_loss(text) and not reads_loss(fuser.rule("p = p - lr * g", hyper=HYPER))
    assert bad("loss = 2\np = p - lr * loss * g").line == 1  # an input, not a temporary
    with pytest.raises(fuser.RuleError, match="reserved"):
        fuser.rule("p = p - lr * g", hyper=dict(lr=0.1, loss=1.0))
