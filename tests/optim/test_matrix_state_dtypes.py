"""A matrix rule's element states in bf16 (``state_dtype``) and bf16 parameters with split
fp32 masters (``master_weights``). Each step is checked against float64 written from the
rule, started from what the optimizer held before it (so that one bf16 rounding of a state
cannot carry into the next step's comparison)."""

from __future__ import annotations

import pytest
import torch

import fuser

LR, BETA, WD, EPS, K = 0.05, 0.9, 0.1, 1.0, 2

# ``p`` is read inside the product (the matrix phase reads the parameter, the master where
# there is one); ``m`` by the matrix phase and written by the update kernel.
RULE = fuser.rule(
    """
    m = beta * m + (1 - beta) * g
    L = L + g @ transpose(g)
    PL = where(every(k), inv_root(L + eps * eye(rows), 2), PL)
    p = p - lr * (PL @ (m + wd * p))
    """,
    name="bf16_states",
    hyper=dict(lr=LR, beta=BETA, wd=WD, eps=EPS, k=float(K)),
    state=dict(m=0.0, L="zeros(rows, rows)", PL="eye(rows)"),
)
SHAPES = [(7, 5), (5, 9), (6,)]


def inv_sqrt64(a: torch.Tensor) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(a)
    return (vec * lam.rsqrt()) @ vec.T


def joined(p: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """A split master's value: bf16 ``p`` plus ``lo`` 2**-16ths of p's bf16 spacing, the
    spacing ``2**(e - 8)`` for ``|p| = f * 2**e``, ``f`` in [0.5, 1)."""
    _, e = torch.frexp(p.double())
    return p.double() + lo.double() * torch.ldexp(torch.ones_like(p, dtype=torch.float64), e - 8 - 16)


def expected(before: dict, p0: torch.Tensor, g: torch.Tensor, step: int):
    """(new p, new m before rounding) in float64 from the states before the step, and how
    far fp32 may take m from it before its rounding to bf16: its two terms' rounding, a
    few 2**-24 of their size (where they cancel, many times m's own bf16 spacing)."""
    rows = p0.shape[0] if p0.dim() > 1 else 1
    g2, p2 = g.double().reshape(rows, -1), p0.reshape(rows, -1)
    # (the step reads the momentum as stored: a value given in fp32 is first rounded)
    m = BETA * before["m"].to(torch.bfloat16).double().reshape(rows, -1) + (1 - BETA) * g2
    L = before["L"].double() + g2 @ g2.T
    PL = (
        inv_sqrt64(L + EPS * torch.eye(rows, dtype=torch.float64)) if step % K == 0 else before["PL"].double()
    )
    terms = BETA * before["m"].double().abs() + (1 - BETA) * g.double().abs()
    return (p2 - LR * PL @ (m + WD * p2)).reshape(p0.shape), m.reshape(p0.shape), 2.0**-22 * terms


def _steps(opt, params, steps, master: bool = False):
    """Run ``steps`` one at a time; yield each tensor's (parameter, its fp32 value before the
    step, expected p, expected m before rounding, state after the step)."""
    for _ in range(steps):
        before = []
        for p in params:
            p.grad = torch.randn(p.shape).to(p)
            st = {k: v.detach().clone().cpu() for k, v in opt.state[p].items()}
            if not st:  # (the first step: the rule's initial states)
                rows = p.shape[0] if p.dim() > 1 else 1
                st = dict(step=0, m=torch.zeros(p.shape), L=torch.zeros(rows, rows), PL=torch.eye(rows))
            p0 = joined(p.detach().cpu(), st["master_lo"]) if "master_lo" in st else p.double().cpu()
            assert master == ("master_lo" in st) or st["step"] == 0
            before.append((st, p0, p.grad.cpu()))
        opt.step()
        for p, (st, p0, g) in zip(params, before):
            yield (p, p0, *expected(st, p0, g, int(st["step"]) + 1), opt.state[p])


def _err(got: torch.Tensor, want: torch.Tensor, p0: torch.Tensor) -> float:
    """``got``'s distance from float64's ``want``, as a fraction of fp32's: storing the
    result (half a spacing, 2**-24 relative; twice that for slack) and computing the step
    (fp32 roots of L + I, condition below ~50, and fp32 products: a few 1e-7 of the update;
    1e-5 allowed)."""
    bound = 2.0**-23 * want.norm() + 1e-5 * (want - p0).norm()
    return float((got.double().cpu() - want).norm() / bound)


def test_bf16_element_states_round_once_per_step(device):
    params = [torch.randn(s).to(device) for s in SHAPES]
    opt = fuser.compile(RULE, state_dtype=torch.bfloat16)(params)
    exact = total = 0
    for p, p0, p_want, m_full, slack, st in _steps(opt, params, 4):
        assert st["m"].dtype == torch.bfloat16 and st["L"].dtype == st["PL"].dtype == torch.float32
        assert _err(p, p_want, p0) < 1  # (the update reads the step's fp32 momentum)
        # The state keeps it rounded to bf16 (nearest: at most half a spacing, 2**-8
        # relative; equal to float64's rounding but for a rare near-tie).
        m = st["m"].double().cpu()
        assert ((m - m_full).abs() <= 2.0**-8 * m_full.abs() + slack).all()
        exact += int((m == m_full.to(torch.bfloat16).double()).sum())
        total += m.numel()
    assert exact >= 0.98 * total, (exact, total)
    assert all(p.dtype == torch.float32 for p in params)


def test_a_state_given_in_another_dtype_is_stored_as_asked(device):
    """A momentum assigned in fp32 to a bf16-state optimizer: the step stores it in bf16
    first (as every fuser optimizer does), reads that in both phases, and keeps the new
    value in bf16."""
    params = [torch.randn(s).to(device) for s in SHAPES]
    opt = fuser.compile(RULE, state_dtype="bf16")(params)
    for p in params:
        p.grad = torch.randn(p.shape).to(device)
    opt.step()
    for p in params:
        opt.state[p]["m"] = opt.state[p]["m"].float() + 0.5
    for p, p0, p_want, m_full, slack, st in _steps(opt, params, 2):
        assert st["m"].dtype == torch.bfloat16 and st["m"] is opt.state[p]["m"]
        assert _err(p, p_want, p0) < 1
        assert ((st["m"].double().cpu() - m_full).abs() <= 2.0**-8 * m_full.abs() + slack).all()


def test_split_masters_hold_what_bf16_parameters_drop(device):
    """bf16 parameters, bf16 states (``"param"``): with ``master_weights`` the parameter's
    value (bf16 and its int16 low part, 2**-16 of a bf16 spacing: 2**-23 of |p| at most)
    follows float64 to fp32's precision; without, each step's rounding to bf16 is 2**-9 of
    |p|, thousands of times more."""
    errs = {}
    for master in ("bf16+int16", None):
        params = [torch.randn(s).to(device, torch.bfloat16) for s in SHAPES]
        opt = fuser.compile(RULE, master_weights=master, state_dtype="param")(params)
        worst = 0.0
        for p, p0, p_want, _, _, st in _steps(opt, params, 4, master=master is not None):
            assert p.dtype == st["m"].dtype == torch.bfloat16 and st["L"].dtype == torch.float32
            got = joined(p.detach().cpu(), st["master_lo"].cpu()) if master else p
            worst = max(worst, _err(got, p_want, p0))
        errs[master] = worst
        assert (master is None) == ("master_lo" not in opt.state[params[0]])
    assert errs["bf16+int16"] < 1 and errs[None] > 1000, errs


def test_state_dict_keeps_dtypes_and_continues_exactly(device):
    def make():
        torch.manual_seed(3)
        params = [torch.randn(s).to(device, torch.bfloat16) for s in SHAPES]
        return params, fuser.compile(RULE, master_weights="bf16+int8", state_dtype="bf16")(params)

    def steps(opt, params, grads):
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    grads = [[torch.randn(s).to(device, torch.bfloat16) for s in SHAPES] for _ in range(4)]
    a, opt_a = make()
    steps(opt_a, a, grads[:2])
    saved = opt_a.state_dict()
    b, opt_b = make()
    with torch.no_grad():
        for x, y in zip(b, a):
            x.copy_(y)
    opt_b.load_state_dict(saved)
    steps(opt_a, a, grads[2:])
    steps(opt_b, b, grads[2:])
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for key, value in opt_a.state[x].items():
            loaded = opt_b.state[y][key]
            assert loaded.dtype == value.dtype and torch.equal(loaded, value), key
        assert opt_b.state[y]["m"].dtype == torch.bfloat16 and opt_b.state[y]["step"].device.type == "cpu"
        assert opt_b.state[y]["master_lo"].dtype == torch.int8


def test_refused_state_dtypes_say_what_to_use():
    before = (RULE.text, RULE.hyper, RULE.state, RULE.outputs)
    cases = [
        ("q8", "8-bit states are not supported for matrix rules"),
        (dict(m="int8"), "8-bit states are not supported for matrix rules"),
        (
            dict(L="bf16"),
            r"state_dtype\['L'\]: 'L' is a matrix state of matrix rule 'bf16_states', kept in fp32",
        ),
        (dict(v="bf16"), r"state_dtype names 'v', which rule 'bf16_states' does not have"),
    ]
    for sd, message in cases:
        with pytest.raises(ValueError, match=message):
            fuser.compile(RULE, state_dtype=sd)
    assert (RULE.text, RULE.hyper, RULE.state, RULE.outputs) == before
