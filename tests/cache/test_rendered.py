"""The on-disk memo of rendered kernels: same sources as rendering afresh, keyed by what
the rule computes, robust to damage."""

import json

import fuser
from fuser.cache import rendered
from fuser.codegen.render import render_optim
from fuser.ir import lower_optim
from fuser.runtime import plans


def fresh_sources(rule, dtypes):
    return [s.text for s in render_optim(lower_optim(rule, dict(dtypes)))]


def test_memo_returns_what_rendering_gives_and_survives_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    rule = fuser.rule(
        "m = b * m + g\np = p - lr * m / norm(m)",
        name="memo_rule",
        hyper=dict(lr=0.1, b=0.9),
        state=dict(m=0.0),
    )
    dtypes = plans.dtype_plan(rule, plans.Options(), "bf16", "fp32")
    plans.forget_plans()
    layout, first = plans.plan_and_sources(rule, dtypes)
    files = list((tmp_path / "cache").rglob("rendered/*/*.json"))
    assert len(files) == 1
    plans.forget_plans()
    layout2, second = plans.plan_and_sources(rule, dtypes)  # from the memo
    assert [s.text for s in first] == [s.text for s in second] == fresh_sources(rule, dtypes)
    assert first == second and layout == layout2 and layout.n_reductions == 1
    # Damage: the entry is ignored, rendered again and rewritten.
    files[0].write_text(json.dumps({"payload": {"slots": []}, "checksum": "0" * 64}))
    plans.forget_plans()
    _, third = plans.plan_and_sources(rule, dtypes)
    assert [s.text for s in third] == fresh_sources(rule, dtypes)
    assert rendered.load(files[0].stem) is not None


def test_function_rules_with_the_same_text_but_other_values_do_not_share_an_entry():
    def make(k):
        @fuser.rule(hyper=dict(lr=0.1))
        def scaled(p, g, *, lr):
            return dict(p=p - lr * k * g)

        return scaled

    a, b = make(2.0), make(3.0)
    assert a.text == b.text
    dtypes = plans.dtype_plan(a, plans.Options(), "fp32", "fp32")
    sa = plans.plan_and_sources(a, dtypes)[1][0].text
    sb = plans.plan_and_sources(b, dtypes)[1][0].text
    assert sa != sb
