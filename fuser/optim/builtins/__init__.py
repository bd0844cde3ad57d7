"""Built-in optimizers, each written as a fuser rule.

Each class takes the same constructor keywords as its torch.optim counterpart (``betas=``
tuples included) and keeps the same ``state_dict`` keys, so checkpoints move both ways.
Keywords that change the shape of the update (``amsgrad``, ``nesterov``, ``centered``,
``momentum`` zero or not) pick a rule variant at construction and must agree across param
groups; the others are hyperparameters, one value per param group. Boolean keywords that
do not change the shape (``maximize``, ``decoupled_weight_decay``) are 0/1 hyperparameters:
``g - 2 * maximize * g`` is exactly ``g`` or ``-g``.

Optimizers torch does not have (Lion, AdEMAMix, Adan, CAME, NorMuon, PSGDKron, Shampoo) follow their
papers, with the keywords and state keys of the authors' reference implementations.

One module per family (``sgd_family``, ``adam_family``, ``adagrad_family``, ``sign``,
``layerwise``, ``factored``, ``orthogonal``, ``kron``, ``schedule_free``, ``shampoo``,
``soap``), each rule beside its class;
``_base`` holds what they share (fuser's own keywords, choosing the variant, checking that
param groups agree on it, reading a group's hyperparameters each step, torch's checks).
Every rule is re-exported here: ``fuser precompile --builtins`` compiles the rules bound in
this module.

Adding one: a rule and a ``BuiltinOptimizer`` subclass beside it, in its family's module.
The class states what differs as data:

- ``rule``: the rule its default keywords select (the class's ``source``).
- ``__init__``: torch's signature and defaults, written out (they are the drop-in's
  contract, positional order included), torch's checks (``check_lr``, ``check_nonneg``,
  ``check_betas``), the param-group ``defaults``, then ``self._init_builtin(...)``.
- ``hyper_from``, only for a hyperparameter not read from the group keyword of its own
  name: ``decoupled=flag("decoupled_weight_decay")``, ``alpha_warmup=steps("alpha_warmup")``.
  Without an entry, ``maximize`` is a 0/1 flag, ``beta1``, ``beta2``, ``beta3`` come from
  ``betas``, and any other name is the group keyword of that name.
- ``variants``, only when keywords change the update's shape:
  ``Variants("amsgrad", key, {(False,): adam, (True,): adam_amsgrad})``.
- ``options = Options(state_keys=...)``, only when a state key differs from the rule's name
  (Adagrad's ``sum``); ``load_state_dict`` or ``add_param_group`` overrides only where
  torch's checkpoints need adapting (SGD, AdamW, Adagrad).

Then its names go into this module and the class into ``fuser.optim``'s exports. A new
Adam-like optimizer is its rule plus::

    class Adamax(BuiltinOptimizer):
        rule = adamax

        def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, *,
                     maximize=False, state_dtype=None, grad_attr="grad",
                     stochastic_rounding=False, seed=0, static=False):
            check_lr(lr)
            check_nonneg(epsilon=eps, weight_decay=weight_decay)
            defaults = dict(lr=lr, betas=check_betas(betas), eps=eps,
                            weight_decay=weight_decay, maximize=maximize)
            self._init_builtin(params, defaults, state_dtype, grad_attr,
                               stochastic_rounding, seed, static)
"""

from fuser.optim.builtins._base import BuiltinOptimizer
from fuser.optim.builtins.adagrad_family import (
    Adagrad,
    RMSprop,
    adagrad,
    rmsprop,
    rmsprop_centered,
    rmsprop_centered_momentum,
    rmsprop_momentum,
)
from fuser.optim.builtins.adam_family import (
    Adam,
    AdamW,
    Adan,
    AdEMAMix,
    NAdam,
    RAdam,
    adam,
    adam_amsgrad,
    adamw,
    adamw_amsgrad,
    adan,
    adan_clipped,
    ademamix,
    nadam,
    radam,
)
from fuser.optim.builtins.factored import CAME, Adafactor, adafactor, came, came_ams_bound
from fuser.optim.builtins.kron import PSGDKron, psgd_kron
from fuser.optim.builtins.layerwise import LAMB, LARS, lamb, lars
from fuser.optim.builtins.orthogonal import (
    Muon,
    NorMuon,
    muon,
    muon_adamw,
    muon_heavy_ball,
    normuon,
    normuon_adamw,
    normuon_heavy_ball,
    normuon_match_rms,
)
from fuser.optim.builtins.schedule_free import ScheduleFreeAdamW, schedule_free_adamw
from fuser.optim.builtins.sgd_family import SGD, sgd, sgd_momentum, sgd_nesterov
from fuser.optim.builtins.shampoo import (
    Shampoo,
    shampoo_filter,
    shampoo_filter_graft,
    shampoo_graft,
    shampoo_update,
    shampoo_update_momentum,
    shampoo_update_nesterov,
)
from fuser.optim.builtins.sign import Lion, lion
from fuser.optim.builtins.soap import SOAP, soap, soap_normalized, soap_precondition

_Builtin = BuiltinOptimizer  # the base's name before the split into modules

__all__ = [
    "CAME",
    "LAMB",
    "LARS",
    "SGD",
    "SOAP",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "AdEMAMix",
    "Adan",
    "BuiltinOptimizer",
    "Lion",
    "Muon",
    "NAdam",
    "NorMuon",
    "PSGDKron",
    "RAdam",
    "RMSprop",
    "ScheduleFreeAdamW",
    "Shampoo",
    "adafactor",
    "adagrad",
    "adam",
    "adam_amsgrad",
    "adamw",
    "adamw_amsgrad",
    "ademamix",
    "adan",
    "adan_clipped",
    "came",
    "came_ams_bound",
    "lamb",
    "lars",
    "lion",
    "muon",
    "muon_adamw",
    "muon_heavy_ball",
    "nadam",
    "normuon",
    "normuon_adamw",
    "normuon_heavy_ball",
    "normuon_match_rms",
    "psgd_kron",
    "radam",
    "rmsprop",
    "rmsprop_centered",
    "rmsprop_centered_momentum",
    "rmsprop_momentum",
    "schedule_free_adamw",
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
    "shampoo_filter",
    "shampoo_filter_graft",
    "shampoo_graft",
    "shampoo_update",
    "shampoo_update_momentum",
    "shampoo_update_nesterov",
    "soap",
    "soap_normalized",
    "soap_precondition",
]
