"""torch.optim's algorithms as its documentation writes them, in float64 with fp32's error
bound (tests/numerics.py): one function per optimizer, one step per gradient, returning the
parameter and the states under torch's keys. Written from the documented pseudo-code, not
from fuser's rules; tests check torch's own fp32 results against them too."""

from __future__ import annotations

import math

import torch
from numerics import Tracked, maximum, sqrt


def _zeros(p: Tracked) -> Tracked:
    return Tracked.exact(torch.zeros(p.value.shape, dtype=torch.float64))


def _lrs(lr, grads) -> list[float]:
    """The learning rate of each step: one number (or tensor) for all, or a list (a scheduler)."""
    if isinstance(lr, (list, tuple)):
        return [float(x) for x in lr]
    return [float(lr)] * len(grads)


def _grad(g, p, weight_decay, maximize):
    g = g if isinstance(g, Tracked) else Tracked.exact(g)
    g = -g if maximize else g
    return g + weight_decay * p if weight_decay else g


def sgd(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    p, state = Tracked.exact(p), {}
    for t, (g, rate) in enumerate(zip(grads, _lrs(lr, grads)), 1):
        g = _grad(g, p, weight_decay, maximize)
        if momentum:
            b = g if t == 1 else momentum * state["momentum_buffer"] + (1 - dampening) * g
            state["momentum_buffer"] = b
            g = g + momentum * b if nesterov else b
        p = p - rate * g
    return p, state


def adam(
    p,
    grads,
    lr,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    amsgrad=False,
    maximize=False,
    decoupled_weight_decay=False,
):
    b1, b2 = betas
    p = Tracked.exact(p)
    m, v, vmax = _zeros(p), _zeros(p), _zeros(p)
    for t, (g, rate) in enumerate(zip(grads, _lrs(lr, grads)), 1):
        g = _grad(g, p, 0.0 if decoupled_weight_decay else weight_decay, maximize)
        if decoupled_weight_decay:
            p = p * (1 - rate * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if amsgrad:
            vmax = maximum(vmax, v)
        denom = sqrt(vmax if amsgrad else v) / math.sqrt(1 - b2**t) + eps
        p = p - rate / (1 - b1**t) * (m / denom)
    state = dict(exp_avg=m, exp_avg_sq=v)
    if amsgrad:
        state["max_exp_avg_sq"] = vmax
    return p, state


def adamw(p, grads, lr, weight_decay=0.01, **kw):
    return adam(p, grads, lr, weight_decay=weight_decay, decoupled_weight_decay=True, **kw)


def adagrad(
    p, grads, lr, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, maximize=False
):
    p = Tracked.exact(p)
    s = Tracked.exact(torch.full(p.value.shape, initial_accumulator_value, dtype=torch.float64))
    for t, (g, rate) in enumerate(zip(grads, _lrs(lr, grads)), 1):
        g = _grad(g, p, weight_decay, maximize)
        clr = rate / (1 + (t - 1) * lr_decay)
        s = s + g * g
        p = p - clr * g / (sqrt(s) + eps)
    return p, dict(sum=s)


def rmsprop(
    p, grads, lr, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, maximize=False
):
    p = Tracked.exact(p)
    sq, avg_g, buf = _zeros(p), _zeros(p), _zeros(p)
    for g, rate in zip(grads, _lrs(lr, grads)):
        g = _grad(g, p, weight_decay, maximize)
        sq = alpha * sq + (1 - alpha) * g * g
        if centered:
            avg_g = alpha * avg_g + (1 - alpha) * g
            avg = sqrt(sq - avg_g * avg_g) + eps
        else:
            avg = sqrt(sq) + eps
        if momentum:
            buf = momentum * buf + g / avg
            p = p - rate * buf
        else:
            p = p - rate * g / avg
    state = dict(square_avg=sq)
    if centered:
        state["grad_avg"] = avg_g
    if momentum:
        state["momentum_buffer"] = buf
    return p, state


def nadam(
    p,
    grads,
    lr,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    momentum_decay=4e-3,
    maximize=False,
    decoupled_weight_decay=False,
):
    b1, b2 = betas
    p = Tracked.exact(p)
    m, v = _zeros(p), _zeros(p)
    mu_product = Tracked.exact(1.0)
    for t, (g, rate) in enumerate(zip(grads, _lrs(lr, grads)), 1):
        g = _grad(g, p, 0.0 if decoupled_weight_decay else weight_decay, maximize)
        if decoupled_weight_decay:
            p = p * (1 - rate * weight_decay)
        mu = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        mu_product = mu_product * mu
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = sqrt(v / (1 - b2**t)) + eps
        p = p - rate * (1 - mu) / (1 - mu_product) * (g / denom)
        p = p - rate * mu_next / (1 - mu_product * mu_next) * (m / denom)
    return p, dict(exp_avg=m, exp_avg_sq=v, mu_product=mu_product)


def radam(
    p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False, decoupled_weight_decay=False
):
    b1, b2 = betas
    p = Tracked.exact(p)
    m, v = _zeros(p), _zeros(p)
    rho_inf = 2 / (1 - b2) - 1
    for t, (g, rate) in enumerate(zip(grads, _lrs(lr, grads)), 1):
        g = _grad(g, p, 0.0 if decoupled_weight_decay else weight_decay, maximize)
        if decoupled_weight_decay:
            p = p * (1 - rate * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho > 5:
            rect = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            p = p - m_hat * rate * (math.sqrt(1 - b2**t) / (sqrt(v) + eps)) * rect
        else:
            p = p - m_hat * rate
    return p, dict(exp_avg=m, exp_avg_sq=v)


REFERENCES = {
    torch.optim.SGD: sgd,
    torch.optim.Adam: adam,
    torch.optim.AdamW: adamw,
    torch.optim.Adagrad: adagrad,
    torch.optim.RMSprop: rmsprop,
    torch.optim.NAdam: nadam,
    torch.optim.RAdam: radam,
}
