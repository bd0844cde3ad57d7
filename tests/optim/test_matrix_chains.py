"""Products of three or more factors run in the order of fewest flops for each stack's sizes
(matrix-chain order), and ``diag(A @ B)`` without the product, with the values of the written
rule: against float64, and by the products torch is asked for."""

from __future__ import annotations

import torch

import fuser

RULE = fuser.rule(
    """
    QL = QL + 0.01 * g @ transpose(g)
    QR = QR + 0.01 * transpose(g) @ g
    u = transpose(QL) @ QL @ g @ transpose(QR) @ QR
    x = QL @ QL @ rowmean(g) + diag(QL @ transpose(QL))
    y = QR @ transpose(QR) @ colmean(g) + diag(transpose(g) @ g)
    p = p - lr * (u + x + y)
    """,
    name="chains",
    hyper=dict(lr=0.01),
    state=dict(QL="eye(rows)", QR="eye(cols)"),
)


def reference(p, g):
    p, g = p.double(), g.double()
    ql = torch.eye(p.shape[0], dtype=torch.float64) + 0.01 * g @ g.T
    qr = torch.eye(p.shape[1], dtype=torch.float64) + 0.01 * g.T @ g
    u = ql.T @ ql @ g @ qr.T @ qr
    x = ql @ ql @ g.mean(1, keepdim=True) + torch.diag(ql @ ql.T)[:, None]
    y = (qr @ qr.T @ g.mean(0, keepdim=True).T).T + torch.diag(g.T @ g)[None, :]
    return p - 0.01 * (u + x + y)


def test_chains_follow_float64_in_their_cheapest_order(monkeypatch):
    shapes = [(23, 5), (23, 5), (4, 9)]  # (tall and wide: the cheapest orders differ)
    start = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    ps = [x.clone() for x in start]
    opt = fuser.compile(RULE)(ps)
    for p, g in zip(ps, grads):
        p.grad = g
    asked = []
    matmul = torch.matmul

    def logged(a, b):
        asked.append((a.shape[-2], a.shape[-1], b.shape[-1]))
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", logged)
    opt.step()
    monkeypatch.undo()
    for x, p, g in zip(start, ps, grads):
        want = reference(x, g)
        err = (p.double() - want).norm() / (want - x.double()).norm()
        assert err < 1e-5, err.item()
    # No [23, 23] @ [23, 23] (QLᵀ QL, QL QLᵀ under diag) and no [9, 9] @ [9, 9]: the square
    # factors multiply the thin values, not each other.
    assert (23, 23, 23) not in asked and (9, 9, 9) not in asked, asked
    assert (23, 23, 5) in asked and (4, 9, 9) in asked
