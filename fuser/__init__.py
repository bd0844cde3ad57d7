"""fuser: optimizer rules and loss epilogues compiled into fused multi-tensor Triton kernels.

adamw = fuser.rule('''
    m = beta1 * m + (1 - beta1) * g
    ...
''', hyper=dict(lr=1e-3, ...), state=dict(m=0.0, v=0.0))
AdamW = fuser.compile(adamw)      # a torch.optim.Optimizer subclass
"""

from fuser.counters import stats
from fuser.errors import RuleError
from fuser.explainer import explain
from fuser.log import configure_from_env as _configure_logging
from fuser.rules import FUNCTIONS as _FUNCTIONS
from fuser.rules import REDUCTIONS as _REDUCTIONS
from fuser.rules import Rule, loss, rule
from fuser.rules.functions import CONSTANTS as _CONSTANTS
from fuser.rules.rule import set_latex_renderer as _set_latex_renderer

__version__ = "0.1.0"
_configure_logging()


def _rule_latex(rule: Rule) -> str:
    from fuser.display import rule_latex  # on first display: the package imports no display code

    return rule_latex(rule)


_set_latex_renderer(_rule_latex)

sqrt = _FUNCTIONS["sqrt"]
rsqrt = _FUNCTIONS["rsqrt"]
exp = _FUNCTIONS["exp"]
log = _FUNCTIONS["log"]
log1p = _FUNCTIONS["log1p"]
expm1 = _FUNCTIONS["expm1"]
abs = _FUNCTIONS["abs"]  # noqa: A001 - the rule language's name
sign = _FUNCTIONS["sign"]
tanh = _FUNCTIONS["tanh"]
approx_tanh = _FUNCTIONS["approx_tanh"]
sigmoid = _FUNCTIONS["sigmoid"]
minimum = _FUNCTIONS["minimum"]
maximum = _FUNCTIONS["maximum"]
where = _FUNCTIONS["where"]
clamp = _FUNCTIONS["clamp"]
cos = _FUNCTIONS["cos"]
sin = _FUNCTIONS["sin"]
mod = _FUNCTIONS["mod"]
# Functions of traced optimizer rules only: the step gate, random values per element and per step.
every = _FUNCTIONS["every"]
rand = _FUNCTIONS["rand"]
randn = _FUNCTIONS["randn"]
rand_step = _FUNCTIONS["rand_step"]
pi = _CONSTANTS["pi"]
# Matrix values of traced optimizer rules (``a @ b`` in rule text is ``matmul(a, b)``).
matmul = _FUNCTIONS["matmul"]
transpose = _FUNCTIONS["transpose"]
eye = _FUNCTIONS["eye"]
eye_dims = _FUNCTIONS["eye_dims"]
gram = _FUNCTIONS["gram"]
modes = _FUNCTIONS["modes"]
solve_modes_upper = _FUNCTIONS["solve_modes_upper"]
solve_modes_lower = _FUNCTIONS["solve_modes_lower"]
prod_dims = _FUNCTIONS["prod_dims"]
trace = _FUNCTIONS["trace"]
diag = _FUNCTIONS["diag"]
triu = _FUNCTIONS["triu"]
tril = _FUNCTIONS["tril"]
eigh = _FUNCTIONS["eigh"]
qr = _FUNCTIONS["qr"]
inv_root = _FUNCTIONS["inv_root"]
inv_root_newton = _FUNCTIONS["inv_root_newton"]
sort_perm = _FUNCTIONS["sort_perm"]
argmax_onehot = _FUNCTIONS["argmax_onehot"]
solve_upper = _FUNCTIONS["solve_upper"]
solve_lower = _FUNCTIONS["solve_lower"]
# Reductions for traced optimizer rules: per tensor, over every tensor, along an axis.
norm = _REDUCTIONS["norm"]
sum = _REDUCTIONS["sum"]  # noqa: A001 - the rule language's name
mean = _REDUCTIONS["mean"]
amax = _REDUCTIONS["amax"]
global_norm = _REDUCTIONS["global_norm"]
global_sum = _REDUCTIONS["global_sum"]
rowsum = _REDUCTIONS["rowsum"]
rowmean = _REDUCTIONS["rowmean"]
rownorm = _REDUCTIONS["rownorm"]
rowamax = _REDUCTIONS["rowamax"]
colsum = _REDUCTIONS["colsum"]
colmean = _REDUCTIONS["colmean"]
colnorm = _REDUCTIONS["colnorm"]
colamax = _REDUCTIONS["colamax"]
# Matrix functions of a tensor's 2-D view.
orthogonalize = _REDUCTIONS["orthogonalize"]


def _check_optim_keywords(options: dict) -> None:
    """A TypeError naming what ``fuser.compile`` takes for an optimizer rule, for others."""
    import inspect

    from fuser.runtime.plans import parse_options

    known = ["name", *inspect.signature(parse_options).parameters]
    unknown = sorted(set(options) - set(known))
    if unknown:
        hint = {
            "max_matrix_dim": "; max_matrix_dim is the optimizer's: Opt(params, max_matrix_dim=...) "
            "or a param group's key",
            "lr": "; hyperparameters are the optimizer's keywords: Opt(params, lr=...)",
        }
        raise TypeError(
            f"fuser.compile got unknown keywords {unknown} for an optimizer rule; it takes "
            f"{', '.join(known)}" + "".join(hint.get(k, "") for k in unknown)
        )


def compile(rule: Rule, **options):  # noqa: A001 - the public name
    """Compile a rule: an optimizer rule gives a ``torch.optim.Optimizer`` subclass, a loss
    rule a callable fused ``linear + loss`` with autograd. A dict of named optimizer rules
    gives one optimizer whose param groups choose their rule (``rule="adamw"``)."""
    if isinstance(rule, dict):  # several optimizer rules, chosen per param group
        from fuser.optim.factory import make_optimizer

        return make_optimizer(rule, **options)
    if not isinstance(rule, Rule):
        raise TypeError(
            f"fuser.compile takes a fuser.Rule (from fuser.rule or fuser.loss), not {type(rule).__name__}"
        )
    if rule.kind == "optim":
        from fuser.rules.matrices import is_matrix_rule

        _check_optim_keywords(options)

        if is_matrix_rule(rule):
            from fuser.optim.matrix_rules import make_matrix_optimizer
            from fuser.runtime.plans import parse_options

            name = options.pop("name", None)
            return make_matrix_optimizer(rule, name, parse_options(**options))
        from fuser.optim.factory import make_optimizer

        return make_optimizer(rule, **options)
    from fuser.losses import make_loss

    return make_loss(rule, **options)


def __getattr__(name):
    # fuser.optim and fuser.losses import torch-heavy modules; load them on first use.
    if name in ("optim", "losses"):
        import importlib

        return importlib.import_module(f"fuser.{name}")
    raise AttributeError(f"module 'fuser' has no attribute {name!r}")


__all__ = [
    "Rule",
    "RuleError",
    "compile",
    "explain",
    "loss",
    "rule",
    "stats",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "log1p",
    "expm1",
    "abs",
    "sign",
    "tanh",
    "approx_tanh",
    "sigmoid",
    "minimum",
    "maximum",
    "where",
    "clamp",
    "norm",
    "sum",
    "mean",
    "amax",
    "global_norm",
    "global_sum",
    "rowsum",
    "rowmean",
    "rownorm",
    "rowamax",
    "colsum",
    "colmean",
    "colnorm",
    "colamax",
    "orthogonalize",
    "matmul",
    "transpose",
    "eye",
    "trace",
    "diag",
    "triu",
    "tril",
    "eigh",
    "qr",
    "inv_root",
    "inv_root_newton",
    "eye_dims",
    "gram",
    "modes",
    "solve_modes_upper",
    "solve_modes_lower",
    "prod_dims",
    "sort_perm",
    "argmax_onehot",
    "solve_upper",
    "solve_lower",
    "optim",
    "losses",
]
