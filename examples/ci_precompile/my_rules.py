"""A project's optimizer rules: `fuser precompile` compiles every module-level rule here.

The training code imports the same objects, so the kernels it launches are exactly the
ones compiled in CI.
"""

import fuser

lion = fuser.rule(
    """
    u = sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    p = p * (1 - lr * weight_decay) - lr * u
    """,
    name="lion",
    hyper=dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0),
    state=dict(m=0.0),
)

Lion = fuser.compile(lion)
