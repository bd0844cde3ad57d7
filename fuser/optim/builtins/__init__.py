"""Built-in optimizers, each written as a fuser rule.

Each class takes the same constructor keywords as its torch.optim counterpart (``betas=``
tuples included) and keeps the same ``state_dict`` keys, so checkpoints move both ways.
Keywords that change the shape of the update (``amsgrad``, ``nesterov``, ``centered``,
``momentum`` zero or not) pick a rule variant at construction and must agree across param
groups; the others are hyperparameters, one value per param group. Boolean keywords that
do not change the shape (``maximize``, ``decoupled_weight_decay``) are 0/1 hyperparameters:
``g - 2 * maximize * g`` is exactly ``g`` or ``-g``.

Optimizers torch does not have (Lion, AdEMAMix, Adan, CAME, NorMuon) follow their papers, with the
keywords and state keys of the authors' reference implementations.

One module per family, each rule beside its class; ``_base`` holds what they share. Every
rule is re-exported here: ``fuser precompile --builtins`` compiles the rules bound in this
module.
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
from fuser.optim.builtins.sign import Lion, lion

_Builtin = BuiltinOptimizer  # the base's name before the split into modules

__all__ = [
    "CAME",
    "LAMB",
    "LARS",
    "SGD",
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
    "RAdam",
    "RMSprop",
    "ScheduleFreeAdamW",
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
    "radam",
    "rmsprop",
    "rmsprop_centered",
    "rmsprop_centered_momentum",
    "rmsprop_momentum",
    "schedule_free_adamw",
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
]
