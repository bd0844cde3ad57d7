"""Shape-aware rules: the sizes of each tensor's 2-D view, axis reductions, states of one
number per row or column, and reductions of row and column values, against float64
references written with torch on the view ``[shape[0], prod(rest)]``."""

import pytest
import torch

import fuser

# Odd sizes: two strips down (257 rows: a program walks 256, 32 tiles of 8 or slim tiles of
# 4, so the second strip is one masked row; the interpreter's time goes by masked rows),
# across (2 x 600), a tile's corner (9 x 257), whole tiles of aligned rows beside partial
# ones (17 x 528), one row (1-D), N-D, a single element and an empty tensor.
SHAPES = [(7, 13), (29,), (3, 5, 4), (257, 17), (2, 600), (9, 257), (17, 528), (1,), (0, 5)]


def view(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.reshape(t.shape[0], -1)


def rel_err(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """``|got - want| / |want|``, or over ``|scale|`` where given (a parameter's start, for
    updates that may cancel it)."""
    got, want = got.detach().cpu().double().reshape(-1), want.detach().cpu().double().reshape(-1)
    if want.numel() == 0:
        return 0.0
    norm = want.norm() if scale is None else torch.maximum(want.norm(), scale.detach().cpu().double().norm())
    return ((got - want).norm() / norm.clamp_min(1e-300)).item()


def params_and_grads(shapes, steps, dtype=torch.float32, device="cpu"):
    """Fresh values on ``device``; references read them back on the CPU."""
    params = [torch.randn(s).to(device, dtype) for s in shapes]
    grads = [[torch.randn(s).to(device, dtype) for s in shapes] for _ in range(steps)]
    return params, grads


def run(opt_cls, params, grads, **kw):
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_cls(mine, **kw)
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.clone()
        opt.step()
    return mine, opt


AXES = fuser.rule(
    """
    u = rowmean(g**2) * g + 0.1 * colsum(g) - 0.05 * colamax(abs(g)) + 0.05 * rowamax(g)
    u = u + 0.01 * rownorm(p) - 0.02 * colnorm(g) + 0.03 * rowsum(p) + 0.2 * colmean(g)
    p = p - lr * u * (rows + 2 * cols) / numel
""",
    name="axes",
    hyper=dict(lr=0.1),
)


def axes_reference(p, g, lr):
    p2, g2 = view(p.double().cpu()), view(g.double().cpu())
    rows, cols = p2.shape
    u = (g2**2).mean(1, keepdim=True) * g2 + 0.1 * g2.sum(0, keepdim=True)
    u = u - 0.05 * g2.abs().amax(0, keepdim=True) + 0.05 * g2.amax(1, keepdim=True)
    u = u + 0.01 * p2.norm(dim=1, keepdim=True) - 0.02 * g2.norm(dim=0, keepdim=True)
    u = u + 0.03 * p2.sum(1, keepdim=True) + 0.2 * g2.mean(0, keepdim=True)
    return (p2 - lr * u * (rows + 2 * cols) / p2.numel()).reshape(p.shape)


def test_axis_reductions_and_view_sizes_match_float64(device):
    shapes = [s for s in SHAPES if 0 not in s]
    params, grads = params_and_grads(shapes, 2, device=device)
    mine, _ = run(fuser.compile(AXES), params, grads, lr=0.1)
    for p, start, g0, g1 in zip(mine, params, grads[0], grads[1]):
        want = axes_reference(axes_reference(start, g0, 0.1), g1, 0.1)
        # Over the start's size too: a 1-element update may all but cancel its parameter.
        assert rel_err(p, want, start) < 2e-6, p.shape


FACTORED = fuser.rule(
    """
    r = beta * r + (1 - beta) * rowmean(g**2)
    c = beta * c + (1 - beta) * colmean(g**2)
    s = s * beta + amax(r) + norm(c) / cols
    v = r * c / mean(r)
    p = p - lr * g / (sqrt(v) + eps) - lr * 1e-3 * s * p
""",
    name="factored",
    hyper=dict(lr=0.01, beta=0.9, eps=1e-8),
    state=dict(r=0.0, c=0.0, s=0.0),
)


def factored_reference(params, grads, lr=0.01, beta=0.9, eps=1e-8):
    out = []
    for i, start in enumerate(params):
        p = view(start.double().cpu())
        r = torch.zeros(p.shape[0], 1, dtype=torch.float64)
        c = torch.zeros(1, p.shape[1], dtype=torch.float64)
        s = torch.zeros((), dtype=torch.float64)
        for gs in grads:
            g = view(gs[i].double().cpu())
            r = beta * r + (1 - beta) * (g**2).mean(1, keepdim=True)
            c = beta * c + (1 - beta) * (g**2).mean(0, keepdim=True)
            s = s * beta + r.amax() + c.norm() / p.shape[1]
            v = r * c / r.mean()
            p = p - lr * g / (v.sqrt() + eps) - lr * 1e-3 * s * p
        out.append((p.reshape(start.shape), r.reshape(-1), c.reshape(-1), s))
    return out


def test_row_column_and_scalar_states_follow_float64_over_steps(device):
    shapes = [s for s in SHAPES if 0 not in s]
    # 3 steps: the row, column and scalar states carry over twice
    params, grads = params_and_grads(shapes, 3, device=device)
    Factored = fuser.compile(FACTORED)
    assert Factored.rule.name == "factored"
    mine, opt = run(Factored, params, grads)
    for p, (want, r, c, s) in zip(mine, factored_reference(params, grads)):
        st = opt.state[p]
        rows, cols = view(p).shape
        assert st["r"].shape == (rows,) and st["c"].shape == (cols,) and st["s"].shape == ()
        assert rel_err(p, want) < 2e-6, p.shape
        assert rel_err(st["r"], r) < 2e-6 and rel_err(st["c"], c) < 2e-6
        assert rel_err(st["s"], s) < 2e-6


def test_a_shaped_step_is_two_launches_whatever_the_number_of_tensors(device):
    # Phases: axis sums; the tails' amax(r), norm(c) and mean(r) need them, so the
    # update runs in a second launch.
    shapes = [(5, 3)] * 3 + [(11,)] * 4
    params, grads = params_and_grads(shapes, 2, device=device)
    mine = [torch.nn.Parameter(p) for p in params]
    opt = fuser.compile(FACTORED)(mine)
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g
        before = fuser.stats()["launches"]
        opt.step()
        assert fuser.stats()["launches"] - before == 2


def test_empty_tensors_and_groups_with_their_own_hyperparameters(device):
    params, grads = params_and_grads([(4, 6), (0, 5), (9,)], 3, device=device)
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.compile(FACTORED)([dict(params=mine[:2], lr=0.02), dict(params=mine[2:])], lr=0.01)
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.clone()
        opt.step()
    ((want0, *_),) = factored_reference([params[0]], [[gs[0]] for gs in grads], lr=0.02)
    ((want2, *_),) = factored_reference([params[2]], [[gs[2]] for gs in grads], lr=0.01)
    assert rel_err(mine[0], want0) < 2e-6 and rel_err(mine[2], want2) < 2e-6
    assert mine[1].shape == (0, 5) and opt.state[mine[1]]["r"].shape == (0,)


def test_bf16_parameters_with_fp32_row_and_column_states(device):
    params, grads = params_and_grads([(33, 70), (70,)], 3, torch.bfloat16, device=device)
    mine, opt = run(fuser.compile(FACTORED), params, grads)
    for p, (want, r, c, _) in zip(mine, factored_reference(params, grads)):
        assert p.dtype == torch.bfloat16 and opt.state[p]["r"].dtype == torch.float32
        # fp32 states follow float64 closely; the parameter carries bf16's rounding each step.
        assert rel_err(opt.state[p]["r"], r) < 2e-6 and rel_err(opt.state[p]["c"], c) < 2e-6
        assert rel_err(p, want) < 3 * 2**-8


def test_a_skipped_amp_step_changes_no_row_or_column_state(device):
    params, grads = params_and_grads([(6, 7), (8,)], 2, device=device)
    mine, opt = run(fuser.compile(FACTORED), params, grads[:1])
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in mine}
    kept = [p.detach().clone() for p in mine]
    for p, g in zip(mine, grads[1]):
        p.grad = g.clone()
    opt.found_inf = torch.ones(())
    opt.step()
    for p, k in zip(mine, kept):
        assert torch.equal(p.detach(), k)
        for key, v in opt.state[p].items():
            assert torch.equal(v, before[id(p)][key]), key


def test_state_dict_round_trip_continues_the_same_run(device):
    params, grads = params_and_grads([(12, 5), (7,), (2, 3, 4)], 4, device=device)
    Factored = fuser.compile(FACTORED)
    straight, _ = run(Factored, params, grads)
    first, opt = run(Factored, params, grads[:2])
    saved = opt.state_dict()
    assert saved["state"][0]["r"].shape == (12,)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Factored(resumed)
    opt2.load_state_dict(saved)
    for gs in grads[2:]:
        for p, g in zip(resumed, gs):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach(), b.detach())


def test_a_state_of_the_wrong_size_is_refused_before_anything_changes(device):
    params, grads = params_and_grads([(4, 6)], 1, device=device)
    mine, opt = run(fuser.compile(FACTORED), params, grads)
    kept = mine[0].detach().clone()
    opt.state[mine[0]]["r"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match="one number per row"):
        opt.step()
    assert torch.equal(mine[0].detach(), kept)


def test_non_contiguous_parameters_are_refused_with_the_fix(device):
    p = torch.nn.Parameter(torch.randn(6, 4, device=device).t())
    p.grad = torch.randn(6, 4, device=device).t()
    opt = fuser.compile(FACTORED)([p])
    with pytest.raises(RuntimeError, match="contiguous"):
        opt.step()


@pytest.mark.parametrize(
    "text, message",
    [
        ("p = p - lr * rowmean(rowmean(g))", r"rowmean\(\) reduces a value per element"),
        ("r = rowmean(g)\np = p - lr * colsum(r) * g", r"colsum\(\) reduces a value per element"),
        ("p = p - lr * global_norm(rowsum(g)) * g", r"global_norm\(\) takes a value per element"),
        ("p = p - lr * rowmean(g, 1)", r"rowmean\(\) takes 1 argument"),
        ("rows = 3\np = p", "'rows' is an input of the rule"),
    ],
)
def test_misuse_of_axis_reductions_names_the_line(text, message):
    with pytest.raises(fuser.RuleError, match=message) as info:
        fuser.compile(fuser.rule(text, hyper=dict(lr=0.1)))
    assert "line" in str(info.value)


def test_traced_rules_use_the_same_axis_reductions(device):
    @fuser.rule(hyper=dict(lr=0.01, beta=0.9, eps=1e-8), state=dict(r=0.0, c=0.0, s=0.0))
    def factored(p, g, r, c, s, *, lr, beta, eps, cols):
        r = beta * r + (1 - beta) * fuser.rowmean(g**2)
        c = beta * c + (1 - beta) * fuser.colmean(g**2)
        s = s * beta + fuser.amax(r) + fuser.norm(c) / cols
        v = r * c / fuser.mean(r)
        return dict(p=p - lr * g / (fuser.sqrt(v) + eps) - lr * 1e-3 * s * p, r=r, c=c, s=s)

    params, grads = params_and_grads([(7, 13), (29,)], 3, device=device)
    mine, _ = run(fuser.compile(factored), params, grads)
    for p, (want, *_) in zip(mine, factored_reference(params, grads)):
        assert rel_err(p, want) < 2e-6


def test_view_sizes_alone_keep_the_elementwise_kernel(device):
    rule = fuser.rule(
        "p = p - lr * g * maximum(1, rows / cols) ** 0.5 * where(ndim > 1, 1, 3)"
        " + lr * numel / (rows * cols) * 1e-3 * ndim",
        name="aspect",
        hyper=dict(lr=0.1),
    )
    Aspect = fuser.compile(rule)
    assert "tile of BR x BC" not in Aspect.source and "One program per block" in Aspect.source
    params, grads = params_and_grads([(40, 3), (3, 40), (17,), (6, 2, 5), ()], 1, device=device)
    mine, _ = run(Aspect, params, grads, lr=0.1)
    for p, start, g in zip(mine, params, grads[0]):
        rows, cols = view(start).shape
        one_d = 3 if start.dim() <= 1 else 1  # (LARS's kind of test: ndim, not the view's rows)
        want = (
            start.double() - 0.1 * g.double() * max(1, rows / cols) ** 0.5 * one_d + 0.1 * 1e-3 * start.dim()
        )
        # Over the start's size too: a 1-element update may all but cancel its parameter
        # (CI seed 1870646491: the 0-d one went to -0.0009, 3.3e-6 of itself off).
        assert rel_err(p, want, start) < 1e-6, p.shape


def test_per_tensor_reductions_beside_axis_reductions_keep_their_own_combine(device):
    # rowmean comes first in the rule, so amax and global_norm are not the first
    # reductions of the plan: each must still take the max or the global total.
    rule = fuser.rule(
        """
        r = rowmean(g**2)
        p = p - lr * g * amax(abs(g)) / (1 + r) / global_norm(g)
        """,
        name="mixed",
        hyper=dict(lr=0.1),
    )
    params, grads = params_and_grads([(7, 13), (29,), (17, 528)], 1, device=device)
    mine, _ = run(fuser.compile(rule), params, grads, lr=0.1)
    total = sum((g.double().cpu() ** 2).sum() for g in grads[0]).sqrt()
    for p, start, g in zip(mine, params, grads[0]):
        s2, g2 = view(start.double().cpu()), view(g.double().cpu())
        r = (g2**2).mean(1, keepdim=True)
        want = s2 - 0.1 * g2 * g2.abs().amax() / (1 + r) / total
        assert rel_err(p, want) < 1e-6, p.shape


def test_means_of_elements_and_of_rows_feed_scalar_states(device):
    rule = fuser.rule(
        """
        s = 0.5 * s + mean(abs(p))
        q = mean(rownorm(p))
        p = p - lr * (s + q) * g
        """,
        name="mean_states",
        hyper=dict(lr=0.1),
        state=dict(s=0.0, q=0.0),
    )
    params, grads = params_and_grads([(7, 13), (29,)], 2, device=device)
    mine, opt = run(fuser.compile(rule), params, grads, lr=0.1)
    for i, p in enumerate(mine):
        ref, s = view(params[i].double().cpu()), 0.0
        for gs in grads:
            s = 0.5 * s + ref.abs().mean()
            q = ref.norm(dim=1).mean()
            ref = ref - 0.1 * (s + q) * view(gs[i].double().cpu())
        assert rel_err(p, ref) < 1e-6 and rel_err(opt.state[p]["s"], s) < 1e-6
        assert rel_err(opt.state[p]["q"], q) < 1e-6


# The parameter read before the last phase only through a term a hyperparameter scales
# (a coupled weight decay): the kernels skip that load when it is zero, as references skip
# a zero decay's term, so an infinite element spoils nothing else; otherwise it counts.
ZEROED = {
    "rows": fuser.rule(
        """
        r = rowmean(g**2 + c * p**2)
        p = p - lr * g / sqrt(r + 1e-3)
        """,
        name="zeroed_rows",
        hyper=dict(lr=0.1, c=0.0),
    ),
    "flat": fuser.rule(
        """
        n = norm(g + c * p)
        p = p - lr * g / (n + 1e-3)
        """,
        name="zeroed_flat",
        hyper=dict(lr=0.1, c=0.0),
    ),
}


def zeroed_reference(kind, p, g, c, lr=0.1):
    p2, g2 = view(p.double().cpu()), view(g.double().cpu())
    if kind == "rows":
        den = ((g2**2 + (c * p2**2 if c else 0.0)).mean(1, keepdim=True) + 1e-3).sqrt()
    else:
        den = (g2 + (c * p2 if c else 0.0)).norm() + 1e-3  # (a zero c drops the term)
    return (p2 - lr * g2 / den).reshape(p.shape)


@pytest.mark.parametrize("kind", ["rows", "flat"])
@pytest.mark.parametrize("c", [0.0, 0.3])
def test_a_term_a_zero_hyperparameter_scales_is_not_read(device, kind, c):
    params, grads = params_and_grads([(7, 13), (29,), (257, 17)], 1, device=device)  # (two strips)
    if c == 0.0:
        for p in params:
            p.view(-1)[0] = float("inf")
    mine, _ = run(fuser.compile(ZEROED[kind]), params, grads, lr=0.1, c=c)
    for p, start, g in zip(mine, params, grads[0]):
        want = zeroed_reference(kind, start, g, c)
        if c == 0.0:  # the infinite element stays so; the rest as if it were not read
            assert p.view(-1)[0].item() == float("inf")
            p, want = p.view(-1)[1:], want.reshape(-1)[1:]
        assert rel_err(p, want) < 2e-6, (start.shape, kind, c)


# A batched view: rows, columns, axis reductions and row and column states per matrix of
# the last two dimensions; reductions of row or column values (mean(r), amax(c)) one value
# per matrix; reductions of element values (norm(u), mean(p), amax(abs(g))) and numel the
# whole tensor's.
BATCHED = fuser.rule(
    """
    r = beta * r + (1 - beta) * rowmean(g**2)
    c = beta * c + (1 - beta) * colmean(g**2)
    v = r * c / mean(r) + amax(c) / cols
    u = g / (sqrt(v) + eps)
    p = p - lr * u / maximum(norm(u) / sqrt(numel), 1) - lr * 1e-2 * (mean(p) + amax(abs(g))) * rows / cols
""",
    name="batched",
    hyper=dict(lr=0.01, beta=0.9, eps=1e-8),
    state=dict(r=0.0, c=0.0),
)


def batched_reference(start, grads, batched=True, lr=0.01, beta=0.9, eps=1e-8):
    """``BATCHED`` in float64 on the matrices of ``start`` (its last two dimensions where
    ``batched`` and it has 3 or more, else its one ``[shape[0], prod(rest)]``)."""
    m, n = start.shape[-2:] if batched and start.dim() >= 3 else view(start).shape
    x = start.double().cpu().reshape(-1, m, n)
    r = torch.zeros(x.shape[0], m, 1, dtype=torch.float64)
    c = torch.zeros(x.shape[0], 1, n, dtype=torch.float64)
    for g in grads:
        g = g.double().cpu().reshape(x.shape)
        r = beta * r + (1 - beta) * (g**2).mean(2, keepdim=True)
        c = beta * c + (1 - beta) * (g**2).mean(1, keepdim=True)
        v = r * c / r.mean(1, keepdim=True) + c.amax(2, keepdim=True) / n
        u = g / (v.sqrt() + eps)
        scale = max((u.norm() / x.numel() ** 0.5).item(), 1.0)
        x = x - lr * u / scale - lr * 1e-2 * (x.mean() + g.abs().amax()) * m / n
    return x.reshape(start.shape), r.reshape(-1), c.reshape(-1)


def test_batched_view_takes_each_matrix_of_the_last_two_dimensions(device):
    # (and a param group's "view" overrides the compiled class's: the flatten group's
    # (3, 5, 4) tensor is one [3, 20] matrix)
    shapes = [(3, 5, 7), (2, 3, 5, 4), (1, 6, 3), (7, 13), (29,), (3, 5, 4)]
    params, grads = params_and_grads(shapes, 3, device=device)
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    Batched = fuser.compile(BATCHED, view="batched")
    opt = Batched([dict(params=mine[:-1]), dict(params=mine[-1:], view="flatten")])
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(mine):
        want, r, c = batched_reference(params[i], [gs[i] for gs in grads], batched=i < len(shapes) - 1)
        assert rel_err(p, want) < 2e-6, p.shape
        assert rel_err(opt.state[p]["r"], r) < 2e-6 and rel_err(opt.state[p]["c"], c) < 2e-6, p.shape
    assert opt.state[mine[1]]["r"].shape == (2, 3, 5) and opt.state[mine[1]]["c"].shape == (2, 3, 4)
    assert opt.state[mine[-1]]["r"].shape == (3,) and opt.state[mine[-1]]["c"].shape == (20,)


def test_batched_view_refuses_what_it_cannot_keep_before_anything_changes(device):
    p = torch.nn.Parameter(torch.randn(3, 5, 16, device=device))
    p.grad = torch.randn(3, 5, 16, device=device)
    start = p.detach().clone()
    # FACTORED keeps s, one number per tensor, which each matrix would update on its own.
    with pytest.raises(RuntimeError, match=r"keeps \['s'\] as one number per tensor"):
        fuser.compile(FACTORED, view="batched")([p]).step()
    # 8-bit blocks of 32 elements: each [5, 16] matrix is 80 of them.
    with pytest.raises(RuntimeError, match="has matrices of 80 elements, not a multiple of that"):
        fuser.optim.Muon([p], state_dtype="int8", view="batched").step()
    with pytest.raises(ValueError, match="view must be 'flatten' or 'batched', not 'cols'"):
        fuser.compile(BATCHED, view="cols")
    opt = fuser.compile(BATCHED)([dict(params=[p], view="matrix")])
    with pytest.raises(ValueError, match="view must be 'flatten' or 'batched', not 'matrix'"):
        opt.step()
    assert torch.equal(p.detach(), start) and not opt.state[p]


@pytest.mark.parametrize("name", ["came", "muon"])
def test_batched_views_keep_8_bit_momentum(name, device):
    # Each matrix is whole 8-bit blocks (CAME: rows of 32; Muon: matrices of 128): q8 steps
    # against fp32-state steps from the same start, apart by the codes' resolution only.
    shape = (3, 5, 32) if name == "came" else (2, 8, 16)
    make = dict(
        came=lambda ps, **kw: fuser.optim.CAME(ps, lr=1e-2, weight_decay=0.01, **kw),
        muon=lambda ps, **kw: fuser.optim.Muon(ps, lr=0.02, view="batched", **kw),
    )[name]
    key = "exp_avg" if name == "came" else "momentum_buffer"
    params, grads = params_and_grads([shape], 3, device=device)
    (full, full_opt), (q8, q8_opt) = (run(make, params, grads, state_dtype=sd) for sd in (None, "q8"))
    assert q8_opt.state[q8[0]][key].dtype == torch.int8
    assert rel_err(q8[0] - params[0], full[0] - params[0]) < 0.05
    assert rel_err(q8_opt.state_dict()["state"][0][key], full_opt.state[full[0]][key]) < 0.03
