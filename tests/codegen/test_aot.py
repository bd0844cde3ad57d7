"""Every generated optimizer kernel compiles ahead of time for sm_80 and sm_90 on a machine
with no GPU: the interpreter forgives mistakes (loop-carried type changes, dtype checks of
math functions) that the compiler rejects."""

import pytest

import fuser
from fuser.cache import precompile
from fuser.codegen.matrix import matrix_kernel_sources
from fuser.codegen.render import render_optim
from fuser.ir import lower_optim

RULES = {
    "adamw": fuser.rule(
        """
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
    """,
        name="adamw",
        hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
        state=dict(m=0.0, v=0.0),
    ),
    # A per-tensor scalar state (NAdam's running product) and every elementwise function.
    "scalar_state": fuser.rule(
        """
        mu = beta1 * (1 - 0.5 * 0.96 ** (step * psi))
        mu_product = mu_product * mu
        m = beta1 * m + (1 - beta1) * g
        u = tanh(m) + sigmoid(g) + log1p(abs(g)) + expm1(-abs(g)) + exp(-g * g) + log(1 + g * g)
        u = u + rsqrt(1 + g * g) + approx_tanh(m) + clamp(g, -1, 1) + minimum(g, m) * maximum(g, m) + sign(g)
        u = where(g > 0 and m < 1, u, -u) + g ** 1.5 * 0
        p = p - lr * (1 - mu) * u / (1 - mu_product)
    """,
        name="scalar_state",
        hyper=dict(lr=1e-3, beta1=0.9, psi=0.004),
        state=dict(m=0.0, mu_product=1.0),
    ),
}


def compile_for(source, capability):
    """The cubin of ``source``, compiled the way fuser precompiles and loads kernels."""
    (result,) = precompile([source], [f"cuda:{capability}"])
    return result.binary.read_bytes()


RULES["clipped_lamb"] = fuser.rule(
    """
    c = g * minimum(1, max_norm / (global_norm(g) + 1e-6))
    m = beta1 * m + (1 - beta1) * c
    u = m / (1 - beta1**step) + wd * p
    p = p - lr * norm(p) / norm(u) * u * amax(abs(c)) / (sum(abs(c)) / numel + mean(c) ** 2)
""",
    name="clipped_lamb",
    hyper=dict(lr=1e-3, beta1=0.9, wd=0.01, max_norm=1.0),
    state=dict(m=0.0),
)

# Shape-aware: every axis reduction, row and column states, a reduction of row values,
# the view's sizes: tiled phases with tails.
RULES["shaped"] = fuser.rule(
    """
    r = beta * r + (1 - beta) * rowmean(g**2) + rowamax(abs(g)) * 0.001
    c = beta * c + (1 - beta) * colmean(g**2) + colamax(g) * 0.001
    n = rownorm(g) + colnorm(p) + rowsum(g) - colsum(g)
    v = r * c / maximum(mean(r), 1e-30) + sum(c) / cols * 0.001
    p = p - lr * g / (sqrt(v) + 1e-8) * where(rows > 1, 1, 0.5) - 1e-4 * lr * n / norm(n)
""",
    name="shaped",
    hyper=dict(lr=1e-3, beta=0.9),
    state=dict(r=0.0, c=0.0),
)

# A matrix function: a phase stores the matrix in bf16, the last reads its orthogonal factor.
RULES["muon"] = fuser.rule(
    """
    m = beta * m + (1 - beta) * g
    p = p * (1 - lr * wd) - lr * maximum(1, rows / cols) ** 0.5 * orthogonalize(g + beta * (m - g), steps=5)
""",
    name="muon",
    hyper=dict(lr=0.02, beta=0.95, wd=0.0),
    state=dict(m=0.0),
)


# 40 cases of 2-20 s each: a quarter a run (tests/README.md, sweeps), every case in 4 runs.
@pytest.mark.sweep(runs=4)
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize(
    "dtypes, sr",
    [
        ({}, False),
        ({"p": "bf16", "g": "bf16", "m": "bf16"}, False),
        ({"p": "fp16", "g": "fp16"}, False),
        ({"p": "bf16", "m": "fp16"}, True),
    ],
)
def test_kernel_compiles_ahead_of_time(rule, capability, dtypes, sr):
    for source in render_optim(lower_optim(RULES[rule], dtypes, stochastic_rounding=sr)):
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("capability", [80, 90])
def test_matrix_kernels_compile_ahead_of_time(capability):
    # Every variant (tall or wide, first iteration or not, with or without masks).
    sources = matrix_kernel_sources()
    assert len({s.digest for s in sources}) == 8
    for source in sources:
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


# The language's trigonometric, remainder and step-gate functions, per step (fp64) and per
# element (fp32), random values per element and per step, the closure's loss, and a
# condition joining a per-step comparison with a per-element one.
LANGUAGE = fuser.rule(
    """
    lr_t = lr * 0.5 * (1 + cos(pi * step / total)) * sin(mod(step, 7) + 1)
    m = beta * m + (1 - beta) * (sin(g) + cos(p) + mod(g, 0.5) + mod(g, -beta)) + 1e-3 * randn()
    m = where(rand() < 0.9, m, 0)
    p = where((every(k) or step < k or rand_step() < 0.5) and not (g > 0 and m < 1), p - lr_t * m * loss, p)
""",
    name="language",
    hyper=dict(lr=1e-3, beta=0.9, total=100.0, k=3.0),
    state=dict(m=0.0),
)


@pytest.mark.parametrize("capability", [80, 90])
def test_language_functions_compile_ahead_of_time(capability):
    (source,) = render_optim(lower_optim(LANGUAGE, {"p": "bf16"}))
    cubin = compile_for(source, capability)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
