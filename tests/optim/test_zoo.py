"""Every rule of examples/zoo.py against the pytorch-optimizer 4.1.0 class it reproduces.

fuser runs the rule on fp32 parameters; the reference runs on float64 copies of the same
starting point. Both see the same fresh, nonzero random gradients for several steps
(``STEPS``, or the entry's ``steps``), and the parameters (and the states both keep) must
agree to a relative error of 1e-6, or the entry's ``rtol`` where fuser's bf16 Newton–Schulz
sets it, against the references' iteration run in float64 (its states from a Newton–Schulz
result to ``NS_RTOL``); an entry whose rule keeps fp32 eigenbases (``basis_states``: SOAP's)
has both bounds widened where the reference's factors have close eigenvalues
(``basis_rtol``). A rule that draws ``randn()`` (PSGD Kron's probes) has its
reference's ``torch.randn_like`` return the rule's own draws, rebuilt in float64 from the
documented generator. A rule that reads ``loss`` (AliG's) steps both optimizers with one
closure returning a fresh number a step."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from test_language import step_uniform  # noqa: E402
from test_matrix_draws import documented_draws  # noqa: E402
from test_muon import exact_newton_schulz  # noqa: E402
from zoo import NOT_EXPRESSIBLE, ZOO, coverage_table  # noqa: E402

import fuser  # noqa: E402
from fuser.rules.rule import reads_loss  # noqa: E402

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

SHAPES = [(7, 13), (29,), (3, 5, 4)]
STEPS = 5
RTOL = 1e-6
# The references' Newton–Schulz runs in float64 here (exact_newton_schulz). fuser's bf16
# iteration is within e <= 5% of it on the zoo's matrices (the smallest, 5 x 12 and
# 7 x 13, reach that; 1-2% on the others), and states of its squares within 2e.
NS_RTOL = 0.1


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got = torch.as_tensor(got).detach().double().cpu()
    want = torch.as_tensor(want).detach().double().cpu().reshape(got.shape)
    scale = want.norm().item()
    return (got - want).norm().item() / (scale if scale > 0 else 1.0)


# An fp32 eigenbasis of a factor whose eigenvalues lie a relative gap apart is within about
# c * 2**-24 / gap of float64's (Davis-Kahan, for a backward-stable eigh); over 600 seeded
# runs of the SOAP entries the error of the second moment times the gap stayed under 20 ulp.
BASIS_ULPS = 64


def basis_rtol(factors: list, rtol: float) -> float:
    """``rtol`` widened to ``BASIS_ULPS`` fp32 ulps over the smallest relative eigengap of
    ``factors`` (the reference's float64 factors; empty ones have no basis)."""
    gaps = []
    for m in factors:
        if len(m) > 1:
            lam = torch.linalg.eigvalsh(m.double())
            gaps.append(float((lam[1:] - lam[:-1]).min() / lam.abs().max().clamp_min(1e-300)))
    return max(rtol, BASIS_ULPS * 2.0**-24 / max(min(gaps), 1e-300)) if gaps else rtol


def reference_state(state: dict, key):
    """A reference's state ``key``, or ``(key, i)``: the ``i``-th tensor of a list (Kron's Q)."""
    return state[key] if isinstance(key, str) else state[key[0]][key[1]]


def rule_probes(opt, step: int, params) -> list[torch.Tensor]:
    """Each tensor's first ``randn()`` of ``step``, rebuilt in float64 from the generator as
    docs/rules.md documents it (``t`` the tensor's position in the optimizer)."""
    return [
        documented_draws(opt.options.seed, step, t, p.numel(), 0, normal=True).reshape(p.shape)
        for t, p in enumerate(params)
    ]


def reference_step(ref, monkeypatch, probes=None, closure=None) -> None:
    """``ref.step(closure)``; with ``probes``, its ``torch.randn_like`` calls (PSGD's, one per
    tensor it refreshes, in order) return them instead of torch's draws."""
    if probes is None:
        ref.step(closure)
        return
    left = list(probes)

    def randn_like(x, *, dtype=None, **_):
        v = left.pop(0)
        assert v.shape == x.shape, (v.shape, x.shape)
        return v.to(dtype or x.dtype)

    with monkeypatch.context() as m:
        m.setattr(torch, "randn_like", randn_like)
        ref.step(closure)


def _cases():
    for name in sorted(ZOO):
        bug = ZOO[name].fuser_bug
        marks = [pytest.mark.xfail(strict=True, reason=f"fuser bug: {bug}")] if bug else []
        yield pytest.param(name, marks=marks)


@pytest.mark.sweep(runs=2)  # half the rules a run, all in 2 runs (tests/README.md, sweeps)
@pytest.mark.parametrize("name", list(_cases()))
def test_rule_follows_its_pytorch_optimizer_reference(name, device, monkeypatch):
    entry = ZOO[name]
    if "orthogonalize(" in entry.rule.text:
        exact_newton_schulz(monkeypatch)
    # A rule's probes are given to its reference in place of torch's draws (PSGD's).
    probes = "randn()" in entry.rule.text
    shapes = entry.shapes or SHAPES
    start = [torch.randn(s) for s in shapes]
    steps = entry.steps or STEPS
    grads = [[torch.randn(s) + 0.1 for s in shapes] for _ in range(steps)]
    losses = [0.5 + 1.5 * torch.rand(()).item() for _ in range(steps)] if reads_loss(entry.rule) else None
    ours = [p.clone().to(device) for p in start]
    theirs = [p.clone().double() for p in start]
    opt = fuser.compile(entry.rule)(ours, **entry.hyper)
    given = [dict(params=theirs, **entry.reference_group)] if entry.reference_group else theirs
    ref = pytorch_optimizer.load_optimizer(entry.reference)(given, **entry.reference_kwargs)
    widest = [(entry.rtol, entry.state_rtol)] * len(ours)  # (widened by close eigenvalues so far)
    for step, step_grads in enumerate(grads, 1):
        for p, q, g in zip(ours, theirs, step_grads):
            p.grad = g.to(device)
            q.grad = g.clone().double()
        closure = (lambda loss=losses[step - 1]: loss) if losses else None
        opt.step(closure)
        reference_step(ref, monkeypatch, rule_probes(opt, step, ours) if probes else None, closure)
        for i, (p, q) in enumerate(zip(ours, theirs)):
            if entry.basis_states:
                widest[i] = tuple(max(w, basis_rtol(ref.state[q][entry.basis_states], w)) for w in widest[i])
            p_rtol, state_rtol = widest[i]
            err = relative_error(p, q)
            assert err <= p_rtol, (
                f"{name}: parameter {i} {tuple(p.shape)}, step {step}: relative error {err:.2e}"
            )
            for keys, rtol in ((entry.states, state_rtol), (entry.ns_states, NS_RTOL)):
                for ours_key, ref_key in keys.items():
                    err = relative_error(opt.state[p][ours_key], reference_state(ref.state[q], ref_key))
                    assert err <= rtol, f"{name}: state {ours_key!r} of parameter {i}, step {step}: {err:.2e}"
    assert all(not torch.equal(p.cpu(), s) for p, s in zip(ours, start)), f"{name}: a parameter never moved"


def test_scionlight_keeps_momentum_in_the_gradient_buffer(device, monkeypatch):
    # SCIONLight's momentum lives in p.grad: it scales p.grad by 1 - momentum after each
    # step and the next backward adds to it. The reference's gradients accumulate here as
    # they would without zero_grad; the rule gets each fresh gradient and keeps the buffer.
    entry = ZOO["scionlight"]
    exact_newton_schulz(monkeypatch)
    momentum = 0.4
    start = [torch.randn(s) for s in entry.shapes]
    ours = [p.clone().to(device) for p in start]
    theirs = [p.clone().double() for p in start]
    opt = fuser.compile(entry.rule)(ours, **{**entry.hyper, "momentum": momentum})
    ref = pytorch_optimizer.load_optimizer(entry.reference)(
        theirs, **{**entry.reference_kwargs, "momentum": momentum}
    )
    # Three steps: the second adds a fresh gradient to the buffer scaled once, the third
    # to one already carried over (every later step repeats that); the zoo test above
    # runs the entry itself (momentum=1) over STEPS.
    for step in range(1, 4):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape) + 0.1
            p.grad = g.to(device)
            q.grad = g.double() if q.grad is None else q.grad + g.double()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            err = relative_error(p, q)
            assert err <= entry.rtol, f"parameter {i} {tuple(p.shape)}, step {step}: relative error {err:.2e}"
            err = relative_error(opt.state[p]["grad_buffer"] * (1 - momentum), q.grad)
            assert err <= RTOL, f"grad_buffer of parameter {i}, step {step}: {err:.2e}"


def test_zoo_names_its_references_and_gaps():
    supported = set(pytorch_optimizer.get_supported_optimizers())
    assert {e.reference for e in ZOO.values()} <= supported
    assert set(NOT_EXPRESSIBLE) <= supported
    assert not set(NOT_EXPRESSIBLE) & {e.reference for e in ZOO.values()}
    assert all(e.doc for e in ZOO.values())


def test_docs_show_the_zoo_coverage_table():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text()
    assert coverage_table() in readme, "paste `python examples/zoo.py --table` into docs/optimizers.md"


# Prodigy is left out: its d starts at 1e-6, so its steps move parameters of size ~1 by
# ~1e-6, and fp32's p0 - p keeps only a few digits of that move; its d then differs from
# the float64 reference's by 0.5-2% (seen over 40 seeds), a property of fp32 parameters.
D_ADAPTED = [n for n in ZOO if n.startswith("dadapt")]


@pytest.mark.parametrize("name", D_ADAPTED)
def test_d_adaptation_follows_its_reference_as_d_grows(name, device):
    # Gradients that keep their direction (a fixed part and some noise) make the distance
    # estimate d grow, so the rule's d update is compared too, not only its start.
    entry = ZOO[name]
    shapes = entry.shapes or SHAPES
    start = [torch.randn(s) for s in shapes]
    base = [torch.randn(s) for s in shapes]
    grads = [[b + 0.1 * torch.randn(b.shape) for b in base] for _ in range(8)]
    ours = [p.clone().to(device) for p in start]
    theirs = [p.clone().double() for p in start]
    opt = fuser.compile(entry.rule)(ours, **entry.hyper)
    ref = pytorch_optimizer.load_optimizer(entry.reference)(theirs, **entry.reference_kwargs)
    d_start = None
    for step, step_grads in enumerate(grads, 1):
        for p, q, g in zip(ours, theirs, step_grads):
            p.grad = g.to(device)
            q.grad = g.clone().double()
        opt.step()
        ref.step()
        d_ref = ref.param_groups[0]["d"]
        d_start = d_ref if d_start is None else d_start
        d_ours = [float(opt.state[p]["d"]) for p in ours]
        assert max(abs(d - d_ref) for d in d_ours) <= 1e-5 * abs(d_ref), (
            name,
            step,
            d_ours,
            d_ref,
        )
        for i, (p, q) in enumerate(zip(ours, theirs)):
            # eight fp32 steps, each scaled by a d that grew tenfold or more: fp32 roundings
            # (1.2e-7 each) add up to 7.8e-6 at worst over 40 seeds (DAdaptAdaGrad)
            err = relative_error(p, q)
            assert err <= max(entry.rtol, 3e-5), (
                f"{name}: parameter {i}, step {step}: relative error {err:.2e}"
            )
    assert d_ref >= 2 * d_start, (
        f"{name}: d went from {d_start:.3g} to {d_ref:.3g}; the test needs it to grow"
    )


def _kron_against_reference(monkeypatch, device, hyper, reference_kwargs, states, steps):
    """The kron rule and pytorch-optimizer's Kron (float64, fed the rule's probes) over
    ``steps``: the largest relative error of the parameters and of ``states``."""
    entry = ZOO["kron"]
    start = [torch.randn(s) for s in entry.shapes]
    ours = [p.clone().to(device) for p in start]
    theirs = [p.clone().double() for p in start]
    opt = fuser.compile(entry.rule)(ours, **hyper)
    ref = pytorch_optimizer.load_optimizer("kron")(
        theirs, precondition_dtype=torch.float64, **reference_kwargs
    )
    worst = [0.0, 0.0]
    for step in range(1, steps + 1):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape) + 0.1
            p.grad, q.grad = g.to(device), g.double()
        opt.step()
        reference_step(ref, monkeypatch, rule_probes(opt, step, ours))
        for p, q in zip(ours, theirs):
            worst[0] = max(worst[0], relative_error(p, q))
            for ours_key, ref_key in states.items():
                got, want = opt.state[p][ours_key], reference_state(ref.state[q], ref_key)
                worst[1] = max(worst[1], relative_error(got, want))
    assert all(not torch.equal(p.cpu(), s) for p, s in zip(ours, start)), "a parameter never moved"
    return worst


def test_kron_follows_its_reference_on_its_default_schedule(device, monkeypatch):
    # The zoo entry refreshes every other step (a fixed probability 0.5) and balances; here the
    # default schedule refreshes every step (prob 1 before step 500) with no balancing, coupled
    # weight decay, maximize, and the gradient (not the momentum) fitted.
    flags = dict(weight_decay=0.1, weight_decouple=0.0, maximize=1.0, momentum_into_precondition_update=0.0)
    worst = _kron_against_reference(
        monkeypatch,
        device,
        dict(lr=0.1, balance_prob=0.0, **flags),
        dict(
            lr=0.1, balance_prob=0.0, **{k: bool(v) if k != "weight_decay" else v for k, v in flags.items()}
        ),
        dict(momentum_buffer="momentum_buffer", QL=("Q", 0), QR=("Q", 1)),
        steps=3,
    )
    assert max(worst) <= RTOL, worst


def test_kron_fits_on_refresh_steps_only(monkeypatch):
    # Its counter is a state per tensor, the same for every tensor: its gate takes one branch,
    # so the fit's triangular solves (2 a tensor) run on refresh steps (2 and 4 at 0.5) only.
    ps = [torch.randn(s) for s in ((7, 5), (5, 7), (7, 5))]
    opt = fuser.compile(ZOO["kron"].rule)(ps, update_prob_max=0.5, update_prob_min=0.5)
    solve, calls = torch.linalg.solve_triangular, []

    def counted(*args, **kwargs):
        calls.append(1)
        return solve(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "solve_triangular", counted)
    per_step = []
    for _ in range(5):
        for p in ps:
            p.grad = torch.randn_like(p)
        calls.clear()
        opt.step()
        per_step.append(len(calls))
    # (the two (7, 5) tensors share a stack: one batched solve for both, on each side)
    assert per_step[0] == per_step[2] == per_step[4] == 0 and per_step[1] == per_step[3] > 0, per_step


def test_kron_balances_a_refresh_with_probability_balance_prob_as_its_reference(device, monkeypatch):
    # The reference balances a refresh when np.random.random() < balance_prob (one draw a step),
    # the rule when its rand_step() is (the rule's second draw, after the probe's randn()):
    # given the rule's coins, the reference balances on the same steps and the factors agree.
    np = pytest.importorskip("numpy")
    coins = [step_uniform(0, step, 1) for step in range(1, 5)]  # (fuser.compile's seed=0)
    assert min(coins) < 0.5 <= max(coins)  # (some steps balance, some do not)
    draws = iter(coins)
    monkeypatch.setattr(np.random, "random", lambda: next(draws))
    worst = _kron_against_reference(
        monkeypatch,
        device,
        dict(lr=0.1, balance_prob=0.5),
        dict(lr=0.1, balance_prob=0.5),
        dict(QL=("Q", 0), QR=("Q", 1)),
        steps=4,
    )
    assert max(worst) <= RTOL, worst


def _kron_diagonal(shape, max_size, mode):
    """pytorch-optimizer's Kron's diagonal factors (``initialize_q_expressions``), written out."""
    if mode == "all_diag":
        return [True] * len(shape)
    marks = [False] * len(shape)
    largest = max(range(len(shape)), key=lambda i: (shape[i], i))  # (argsort's last of a tie)
    ranked = sorted(shape)
    if mode == "one_diag" or (mode == "smart_one_diag" and len(shape) >= 2 and ranked[-1] > ranked[-2]):
        marks[largest] = True
    return [m or d == 1 or d > max_size or len(shape) < 2 for m, d in zip(marks, shape)]


@pytest.mark.parametrize(
    ("max_size", "mode", "shapes"),
    [
        (4, None, ((3, 5, 2), (6,), (4, 1, 3), (7, 3))),  # (sizes 1, over the limit, 1-D)
        (8192, "one_diag", ((3, 5, 2), (4, 4, 2), (4, 3))),
        (8192, "smart_one_diag", ((3, 5, 2), (4, 4, 2), (5, 3))),  # (no diagonal on (4, 4, 2))
        (8192, "all_diag", ((3, 5, 2), (4, 3))),
    ],
)
def test_kron_dims_with_diagonal_factors_follows_its_reference(max_size, mode, shapes, device, monkeypatch):
    # The same rule text with diagonal_dims marking the dimensions the reference keeps as
    # diagonals: its triangular step, solves, bound and balance take their diagonal meaning.
    entry = ZOO["kron_dims"]
    start = [torch.randn(s) for s in shapes]
    ours = [p.clone().to(device) for p in start]
    theirs = [p.clone().double() for p in start]
    marks = lambda shape: tuple(_kron_diagonal(shape, max_size, mode))  # noqa: E731
    opt = fuser.compile(entry.rule)(ours, diagonal_dims=marks, **entry.hyper)
    kwargs = dict(entry.reference_kwargs, max_size_triangular=max_size, memory_save_mode=mode)
    ref = pytorch_optimizer.load_optimizer("kron")([dict(params=theirs, **entry.reference_group)], **kwargs)
    for step in range(1, 6):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape) + 0.1
            p.grad, q.grad = g.to(device), g.double()
        opt.step()
        reference_step(ref, monkeypatch, rule_probes(opt, step, ours))
        for i, (p, q) in enumerate(zip(ours, theirs)):
            assert relative_error(p, q) <= RTOL, (i, step, relative_error(p, q))
            for k, diagonal in enumerate(marks(p.shape)):
                got, want = opt.state[p][f"Q[{k}]"], ref.state[q]["Q"][k]
                assert got.shape == want.shape == ((p.shape[k],) if diagonal else (p.shape[k],) * 2)
                assert relative_error(got, want) <= RTOL, (i, k, step, relative_error(got, want))
    moved = [float((p.cpu() - s).norm() / s.norm()) for p, s in zip(ours, start)]
    assert min(moved) > 1e-3, moved
