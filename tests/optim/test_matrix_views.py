"""Matrix rules on tensors of three dimensions: ``view="batched"`` gives each matrix of the
leading dimensions its own factors (expert weights), and a per-tensor reduction of a
value per element still covers the whole tensor; ``"flatten"`` one factor pair for
``[shape[0], prod(rest)]``. References in float64, per matrix, written from the rule."""

from __future__ import annotations

import torch

import fuser

LEFT = fuser.rule(
    """
    L = beta * L + g @ transpose(g) / mean(g**2)
    PL = inv_root(L + eps * eye(rows), 2)
    u = PL @ g
    p = p - lr * u / norm(u)
    """,
    name="left_root",
    hyper=dict(lr=0.1, beta=0.5, eps=1e-3),
    state=dict(L="zeros(rows, rows)", PL="eye(rows)"),
)


# fp32 eigendecompositions of the small factors against float64: the inverse roots' error is
# about cond(L) * 2**-24; 1e-4 keeps a margin over the 1.5e-5 seen, and a per-matrix mean
# where the tensor's is meant moves the parameters by ~2e-3.
TOL = 1e-4


def reference(p: torch.Tensor, grads: list, matrices: list[tuple[int, int]]) -> torch.Tensor:
    """The rule in float64 on ``p`` seen as ``matrices`` (each a view's [rows, cols]); the
    mean (in the matrix phase) and the norm (in the update) over the whole tensor."""
    p = p.double().clone()
    rows, cols = matrices
    n = p.numel() // (rows * cols)
    L = torch.zeros(n, rows, rows, dtype=torch.float64)
    for g in grads:
        g = g.double().reshape(n, rows, cols)
        L = 0.5 * L + g @ g.mT / g.square().mean()
        lam, vec = torch.linalg.eigh(L + 1e-3 * torch.eye(rows, dtype=torch.float64))
        PL = (vec * lam.rsqrt().unsqueeze(-2)) @ vec.mT
        u = PL @ g
        p = p - 0.1 * (u / u.norm()).reshape(p.shape)
    return p, L


def test_batched_view_factors_each_matrix_and_norms_the_whole_tensor():
    experts = torch.randn(3, 4, 7)
    other = torch.randn(4, 7)  # (a 2-D tensor of the same matrix shape: one stack)
    grads = [[torch.randn(t.shape) for t in (experts, other)] for _ in range(3)]
    ps = [experts.clone(), other.clone()]
    opt = fuser.compile(LEFT, view="batched")(ps)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    assert opt.state[ps[0]]["L"].shape == (3, 4, 4) and opt.state[ps[1]]["L"].shape == (4, 4)
    for k, (p, start) in enumerate(zip(ps, (experts, other))):
        want, L = reference(start, [gs[k] for gs in grads], (4, 7))
        err = (p.double() - want).norm() / want.norm()
        assert err < TOL, (k, err.item())
        got_l = opt.state[p]["L"].double().reshape(L.shape)
        assert (got_l - L).norm() / L.norm() < TOL


def test_flatten_view_takes_one_factor_for_the_whole_tensor():
    start = torch.randn(3, 2, 5)
    grads = [torch.randn(start.shape) for _ in range(2)]
    p = start.clone()
    opt = fuser.compile(LEFT)([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want, L = reference(start, grads, (3, 10))
    assert opt.state[p]["L"].shape == (3, 3)
    assert (p.double() - want).norm() / want.norm() < TOL


def test_a_param_groups_view_overrides_the_compiled_one():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    opt = fuser.compile(LEFT)([dict(params=[a]), dict(params=[b], view="batched")])
    a.grad, b.grad = torch.randn(a.shape), torch.randn(b.shape)
    opt.step()
    assert opt.state[a]["L"].shape == (2, 2) and opt.state[b]["L"].shape == (2, 3, 3)
