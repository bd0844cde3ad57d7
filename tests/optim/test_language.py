"""Functions and inputs of the optimizer rule language beyond arithmetic: conditions that
join per-step and per-element comparisons, against float64 references written here."""

import math

import pytest
import torch
from numerics import Tracked, U, assert_fp32_close, cos, sin

import fuser

# Sizes that cross a flat block (2048 elements) and its masked tail; a 2-D one for tiles.
SHAPES = [(7,), (2500,), (33, 5)]


def where(cond, a, b) -> Tracked:
    """``where`` of Tracked values: each element keeps the error of the branch it takes."""
    a, b = Tracked.of(a), Tracked.of(b)
    return Tracked(torch.where(cond, a.value, b.value), torch.where(cond, a.err, b.err))


def run(rule, params, grads, **hyper):
    opt = fuser.compile(rule)(params, **hyper)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return opt


MIXED = """
    p = where((step >= k) and (g > 0), p - lr * g, p)
    m = where((step < k) or (g < 0), m + g, m - lr)
    v = where(not ((step >= k) or (abs(g) > 0.5)), v + g * g, v)
"""


@pytest.mark.parametrize("tiled", [False, True], ids=["flat", "tiled"])
def test_and_or_not_join_per_step_and_per_element_conditions(device, tiled):
    # `step >= k` flips between steps 2 and 3; every element condition is decided exactly
    # (g as stored), so only the arithmetic of the branches rounds. The tiled variant
    # (a row state) walks tiles of each tensor's 2-D view instead of flat blocks.
    text = MIXED + ("    r = 0.5 * r + rowmean(g)\n" if tiled else "")
    state = dict(m=0.0, v=0.0, **(dict(r=0.0) if tiled else {}))
    rule = fuser.rule(text, hyper=dict(lr=1e-2, k=2.5), state=state)
    shapes = [(7,), (19, 133)] if tiled else SHAPES  # (tiles under the interpreter are slow)
    params = [torch.randn(s, device=device) for s in shapes]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(4)]
    opt = run(rule, params, grads, lr=0.05)
    for i, p in enumerate(params):
        want_p = Tracked.exact(start[i])
        want_m = want_v = Tracked.exact(torch.zeros(shapes[i]))
        for step, gs in enumerate(grads, 1):
            g = gs[i].double().cpu()
            late = step >= 2.5
            want_p = where(late & (g > 0), want_p - 0.05 * Tracked.exact(g), want_p)
            want_m = where((not late) | (g < 0), want_m + Tracked.exact(g), want_m - 0.05)
            want_v = where(~(late | (g.abs() > 0.5)), want_v + Tracked.exact(g) * Tracked.exact(g), want_v)
        assert_fp32_close(p, want_p, "p")
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert_fp32_close(opt.state[p]["v"], want_v, "v")


def test_cosine_schedule_and_every_k_are_per_step_values_in_fp64(device):
    # A cosine learning rate inside the rule (through step = total and past it), applied on
    # every third step only; mod(step, 2.5) as a per-step factor.
    rule = fuser.rule(
        """
        lr_t = lr * 0.5 * (1 + cos(pi * step / total))
        p = where(every(k), p - lr_t * g, p - lr * mod(step, 2.5) * g)
        """,
        hyper=dict(lr=1e-2, total=5.0, k=3.0),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(7)]
    run(rule, params, grads, lr=0.1)
    for i, p in enumerate(params):
        want = Tracked.exact(start[i])
        for step, gs in enumerate(grads, 1):
            g = Tracked.exact(gs[i])
            if step % 3 == 0:
                # the per-step factor is folded in fp64 and reaches the body rounded once
                want = want - Tracked.constant(0.1 * 0.5 * (1 + math.cos(math.pi * step / 5.0))) * g
            else:
                want = want - Tracked.constant(0.1 * math.fmod(step, 2.5)) * g
        assert_fp32_close(p, want, "p")


def test_sin_cos_and_mod_per_element(device):
    rule = fuser.rule(
        """
        m = sin(3 * g) - cos(p)
        r = mod(g, b)
        s = mod(g, -b)
        p = p - lr * m
        """,
        hyper=dict(lr=1e-2, b=0.3),
        state=dict(m=0.0, r=0.0, s=0.0),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES]]
    opt = run(rule, params, grads)
    b = torch.tensor(0.3, dtype=torch.float32).item()  # the kernel's fp32 hyperparameter
    for i, p in enumerate(params):
        g, p0 = Tracked.exact(grads[0][i]), Tracked.exact(start[i])
        want_m = sin(3 * g) - cos(p0)
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert_fp32_close(p, p0 - 1e-2 * want_m, "p")
        x = grads[0][i].double().cpu()
        for name, d in (("r", b), ("s", -b)):
            got = opt.state[p][name].double().cpu()
            want = torch.remainder(x, d)  # Python's convention: the sign of the divisor
            lo, hi = min(0.0, d), max(0.0, d)
            assert bool(((got >= lo) & (got <= hi)).all()), name
            # a / b rounded to fp32 may land on the other side of a multiple of b: the
            # result then jumps by b; elsewhere it is within a few roundings of |a|
            edge = (want.abs() < 1e-5) | ((want - d).abs() < 1e-5)
            close = (got - want).abs() <= 4 * U * (x.abs() + abs(d))
            assert bool((close | edge).all()), name
            assert int(edge.sum()) <= 2


# --- rand() and randn(): the documented generator, written here in torch -------------------

M32 = 0xFFFFFFFF


def mul32(x, c: int):
    """``x * c`` modulo 2**32 for int64 tensors of 32-bit values (in halves: no overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def hash32(x):
    """The kernels' 32-bit mixer (``_hash32``), on int64 tensors or Python ints."""
    if isinstance(x, int):
        return int(hash32(torch.tensor([x], dtype=torch.int64))[0])
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rand_bits(seed: int, step: int, tensor: int, n: int, counter: int):
    """The 32 random bits of ``counter`` at elements 0 .. n-1 of table row ``tensor``: the
    stream key of (seed, step, tensor), made apart from stochastic rounding's."""
    k = hash32((seed & M32) ^ hash32(((seed >> 32) & M32) ^ 0x9E3779B9))
    k = hash32(k ^ step)
    key = hash32(hash32(k ^ tensor ^ 0x85EBCA6B) ^ 0x52414E44)
    return hash32(torch.arange(n, dtype=torch.int64) ^ hash32((key + counter) & M32))


def uniform(seed, step, tensor, n, call):
    """The ``call``-th draw of the rule (counting rand() and randn() together) as rand()."""
    return (rand_bits(seed, step, tensor, n, 2 * call) >> 8).double() * 2.0**-24


def normal(seed, step, tensor, n, call):
    u1 = ((rand_bits(seed, step, tensor, n, 2 * call) >> 8).double() + 1) * 2.0**-24
    u2 = (rand_bits(seed, step, tensor, n, 2 * call + 1) >> 8).double() * 2.0**-24
    return torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)


DRAWS = """
    u = randn()
    a = rand()
    d = rand() - rand()
    n = u / norm(u)
    p = p - lr * a * g
"""


def draw(seed, steps, shapes, device, text=DRAWS, state=("a", "d", "n")):
    """Run ``steps`` steps of the rule; the states after each, per tensor."""
    rule = fuser.rule(text, hyper=dict(lr=0.1), state={s: 0.0 for s in state})
    params = [torch.randn(s, device=device) for s in shapes]
    opt = fuser.compile(rule, seed=seed)(params)
    seen = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        seen.append([{s: opt.state[p][s].double().cpu().reshape(-1).clone() for s in state} for p in params])
    return seen


def test_rand_and_randn_follow_the_documented_generator(device, seed):
    shapes, mine = [(7,), (2500,), (33, 5)], seed % 2**40
    seen = draw(mine, 2, shapes, device)
    for step, per_tensor in enumerate(seen, 1):
        for t, (shape, got) in enumerate(zip(shapes, per_tensor)):
            n = math.prod(shape)
            # calls in the order written: randn (0), rand (1), rand (2), rand (3)
            assert torch.equal(got["a"], uniform(mine, step, t, n, 1))  # exact in fp32
            assert torch.equal(got["d"], uniform(mine, step, t, n, 2) - uniform(mine, step, t, n, 3))
            u = normal(mine, step, t, n, 0)
            # the norm of phase 1 over the values phase 2 reads again
            torch.testing.assert_close(got["n"], u / u.norm(), rtol=2e-5, atol=1e-6)


def test_draws_are_reproducible_and_differ_across_steps_tensors_and_seeds(device, seed):
    shapes = [(2500,), (2500,)]
    first, again = draw(seed, 2, shapes, device), draw(seed, 2, shapes, device)
    other = draw(seed + 1, 1, shapes, device)
    for s in ("a", "n"):
        assert all(torch.equal(x[s], y[s]) for st1, st2 in zip(first, again) for x, y in zip(st1, st2))
        a1, a2 = first[0][0][s], first[1][0][s]
        b1, c1 = first[0][1][s], other[0][0][s]
        for x, y in ((a1, a2), (a1, b1), (a1, c1)):  # steps, tensors, seeds
            assert float((x == y).double().mean()) < 0.01
        assert a1.unique().numel() > 2400  # elements


def test_draws_are_statistically_sane(device, seed):
    # 5000 draws of each: means and standard deviations within 5 standard errors
    (per_tensor,) = draw(seed, 1, [(2500,), (50, 50)], device)
    a = torch.cat([x["a"] for x in per_tensor])
    n = a.numel()
    assert bool(((a >= 0) & (a < 1)).all())
    assert abs(float(a.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / n**0.5
    assert abs(float(a.std()) - (1 / 12) ** 0.5) < 5 * 0.0745 / n**0.5  # (the sd of a uniform's sd)
    # randn() itself, as the kernel normalised it per tensor
    raw = [normal(seed, 1, t, 2500, 0) for t in range(2)]
    for x, r in zip(per_tensor, raw):
        torch.testing.assert_close(x["n"], r / r.norm(), rtol=2e-5, atol=1e-6)
    raw = torch.cat(raw)
    assert abs(float(raw.mean())) < 5 / n**0.5
    assert abs(float(raw.std()) - 1) < 5 / (2 * n) ** 0.5
    assert float(raw.abs().max()) <= (48 * math.log(2)) ** 0.5


def test_draws_of_a_tiled_rule_are_those_of_the_flat_one(device, seed):
    # a row state walks tiles of the 2-D view: each element still draws at its flat index
    text = "r = 0.5 * r + rowmean(g)\na = rand() + 0 * r\nb = randn()\np = p - lr * a * g"
    (per_tensor,) = draw(seed, 1, [(19, 133)], device, text=text, state=("r", "a", "b"))
    assert torch.equal(per_tensor[0]["a"], uniform(seed, 1, 0, 19 * 133, 0))
    torch.testing.assert_close(per_tensor[0]["b"], normal(seed, 1, 0, 19 * 133, 1), rtol=1e-5, atol=1e-5)


# --- loss: the value of the step's closure ---------------------------------------------------

LOSS_RULE = """
    ema = where(step == 1, loss, beta * ema + (1 - beta) * loss)
    p = p - lr * g * loss / ema
"""


def step_uniform(seed: int, step: int, call: int) -> float:
    """``rand_step()``'s value for the rule's ``call``-th draw: the stream key of (seed, step,
    tensor 0), made apart from rand()'s, one counter per call."""
    k = hash32((seed & M32) ^ hash32(((seed >> 32) & M32) ^ 0x9E3779B9))
    key = hash32(hash32(hash32(k ^ step) ^ 0x85EBCA6B) ^ 0x53544550)
    return (hash32((key + call) & M32) >> 8) * 2.0**-24


STEP_GATE = """
    u = rand_step()
    w = rand_step()
    hits = where(u < prob, hits + 1, hits)
    first = u
    second = w
    L = where(u < prob, L + eye(rows), L)
    p = p - lr * (L @ g) / (hits + 1)
"""


def test_rand_step_is_one_documented_value_per_step_in_kernels_and_matrix_gates(device, seed):
    """Two calls, two streams; every tensor reads the same values; the kernels' count of
    the gate's hits (a scalar state) and the matrix phase's gate on ``L`` (in torch) agree
    with each other and with the generator written here, and the gate fires at about its
    probability."""
    mine, prob, steps = seed % 2**40, 0.3, 40
    rule = fuser.rule(
        STEP_GATE, hyper=dict(lr=1e-3, prob=prob), state=dict(hits=0.0, first=0.0, second=0.0, L="eye(rows)")
    )
    params = [torch.randn(s, device=device) for s in ((7,), (33, 5))]
    opt = fuser.compile(rule, seed=mine)(params)
    want_hits = 0
    for step in range(1, steps + 1):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        u, w = step_uniform(mine, step, 0), step_uniform(mine, step, 1)
        want_hits += u < prob
        for p in params:
            st = opt.state[p]
            assert float(st["first"]) == u and float(st["second"]) == w, step
            assert float(st["hits"]) == want_hits
        diag = torch.diagonal(opt.state[params[1]]["L"]).cpu()
        assert torch.equal(diag, torch.full((33,), 1.0 + want_hits)), step
    assert 3 <= want_hits <= 21  # (Binomial(40, 0.3): 12 +- 2.9; outside 3..21 once in 1e4)
    other = fuser.compile(rule, seed=mine + 1)([torch.randn(3, device=device)])
    other.param_groups[0]["params"][0].grad = torch.ones(3, device=device)
    other.step()
    assert float(other.state[other.param_groups[0]["params"][0]]["first"]) != step_uniform(mine, 1, 0)


def model_and_closure(device, opt_box, record):
    """A least-squares problem of two weights; the closure records its loss and gradients."""
    w1 = torch.randn(37, device=device, requires_grad=True)
    w2 = torch.randn(5, 3, device=device, requires_grad=True)
    x1, x2 = torch.randn(37, device=device), torch.randn(3, device=device)

    def closure():
        opt_box[0].zero_grad()
        loss = ((w1 * x1 - 1) ** 2).mean() + ((w2 @ x2 - 2) ** 2).mean()
        loss.backward()
        record.append((loss.detach().double().item(), w1.grad.clone(), w2.grad.clone()))
        return loss

    return [w1, w2], closure


def test_rule_reads_the_closures_loss(device):
    rule = fuser.rule(LOSS_RULE, hyper=dict(lr=0.05, beta=0.8), state=dict(ema=0.0))
    box, record = [None], []
    (w1, w2), closure = model_and_closure(device, box, record)
    start = [w1.detach().clone(), w2.detach().clone()]
    # two param groups: the loss reaches each group's row
    box[0] = opt = fuser.compile(rule)([dict(params=[w1]), dict(params=[w2], lr=0.02)])
    returned = [opt.step(closure) for _ in range(4)]
    assert all(torch.is_tensor(r) and r.requires_grad for r in returned)  # as torch.optim returns
    for i, (lr, w) in enumerate(((0.05, w1), (0.02, w2))):
        want, stored = Tracked.exact(start[i]), None
        for step, (loss, *grads) in enumerate(record, 1):
            # ema is a per-tensor scalar state: folded in fp64, stored in fp32 between steps
            ema = loss if step == 1 else 0.8 * stored + 0.2 * loss
            stored = float(torch.tensor(ema, dtype=torch.float32))
            want = want - Tracked.constant(lr * loss / ema) * Tracked.exact(grads[i])
        assert_fp32_close(w, want, f"w{i + 1}")
        assert float(opt.state[w]["ema"]) == stored


def test_a_rule_that_reads_loss_needs_a_closure_returning_one_number(device):
    rule = fuser.rule(LOSS_RULE, hyper=dict(lr=0.05, beta=0.8), state=dict(ema=0.0))
    box, record = [None], []
    params, closure = model_and_closure(device, box, record)
    box[0] = opt = fuser.compile(rule)(params)
    closure()  # gradients, but no closure at the step
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"reads `loss`: call step\(closure\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state
    with pytest.raises(TypeError, match="not NoneType"):
        opt.step(lambda: None)
    with pytest.raises(ValueError, match=r"one real number, not a tensor of shape \(2,\)"):
        opt.step(lambda: torch.ones(2, device=device))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    opt.step(lambda: 0.5)  # a Python number is a loss too
    assert float(opt.state[params[0]]["ema"]) == 0.5


def test_rules_without_loss_take_no_closure_value():
    rule = fuser.rule("p = p - lr * g", hyper=dict(lr=0.1))
    from fuser.ir.optim import hyper_columns

    assert hyper_columns(rule) == ("lr",)
    assert hyper_columns(fuser.rule(LOSS_RULE, hyper=dict(lr=0.05, beta=0.8), state=dict(ema=0.0))) == (
        "lr",
        "beta",
        "loss",
    )


@pytest.mark.gpu
def test_the_loss_reaches_the_kernel_without_a_host_sync():
    device = torch.device("cuda")
    rule = fuser.rule(LOSS_RULE, hyper=dict(lr=0.05, beta=0.8), state=dict(ema=0.0))
    w = torch.randn(4096, device=device, requires_grad=True)
    opt = fuser.compile(rule)([w])

    def closure():
        opt.zero_grad(set_to_none=False)
        loss = (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)  # builds the tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step(closure)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
