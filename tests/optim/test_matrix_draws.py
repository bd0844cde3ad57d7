"""Random probes of matrix rules: the matrix phase's ``rand()`` / ``randn()`` follow the
generator docs/rules.md documents (written here from that text, in Python integers and
float64), with ``t`` the parameter's position in the optimizer, and one draw read by both
the matrix phase and the update is the same value."""

from __future__ import annotations

import math

import torch

import fuser

M = 0xFFFFFFFF


def h(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def documented_draws(seed: int, step: int, t: int, n: int, i: int, normal: bool) -> torch.Tensor:
    """The ``i``-th draw of a rule at elements ``0..n-1`` (docs/rules.md, "Functions")."""
    k = h((seed & M) ^ h(((seed >> 32) & M) ^ 0x9E3779B9))
    k = h(k ^ step)
    key = h(h(k ^ t ^ 0x85EBCA6B) ^ 0x52414E44)
    out = []
    for e in range(n):
        b1 = h(e ^ h((key + 2 * i) & M))
        if normal:
            b2 = h(e ^ h((key + 2 * i + 1) & M))
            u1, u2 = ((b1 >> 8) + 1) * 2.0**-24, (b2 >> 8) * 2.0**-24
            out.append(math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2))
        else:
            out.append((b1 >> 8) * 2.0**-24)
    return torch.tensor(out, dtype=torch.float64)


PROBE = fuser.rule(
    """
    V = randn()
    U = rand()
    L = L + V @ transpose(V)
    p = U + 0 * p
    """,
    name="probe",
    hyper=dict(),
    state=dict(L="zeros(rows, rows)"),
)


def test_matrix_phase_draws_follow_the_documented_generator():
    seed = 12345
    ps = [torch.zeros(3, 5), torch.zeros(4, 2), torch.zeros(3, 5)]  # (two of one shape: one batch)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = fuser.compile(PROBE, seed=seed)(ps)
    for step in (1, 2):
        before = (
            [opt.state[p]["L"].clone() for p in ps]
            if step > 1
            else [torch.zeros(p.shape[0], p.shape[0]) for p in ps]
        )
        opt.step()
        for t, p in enumerate(ps):
            v = documented_draws(seed, step, t, p.numel(), 0, normal=True).reshape(p.shape)
            u = documented_draws(seed, step, t, p.numel(), 1, normal=False).reshape(p.shape)
            # rand() is exact in fp32; randn() within fp32's log and cos (a few ulps).
            assert torch.equal(p.double(), u), (step, t)
            got = opt.state[p]["L"].double() - before[t].double()
            err = (got - v @ v.T).norm() / (v @ v.T).norm()
            assert err < 1e-6, (step, t, err.item())


def test_one_draw_read_by_the_matrix_phase_and_the_update_is_one_value():
    rule = fuser.rule(
        """
        V = randn()
        L = L + V @ transpose(V)
        p = V
        """,
        name="same_draw",
        hyper=dict(),
        state=dict(L="zeros(rows, rows)"),
    )
    p = torch.zeros(4, 3)
    p.grad = torch.ones_like(p)
    opt = fuser.compile(rule, seed=3)([p])
    opt.step()
    assert torch.allclose(opt.state[p]["L"], p @ p.T, rtol=1e-6, atol=0)
    assert p.std() > 0.3  # (a draw, not zeros)
