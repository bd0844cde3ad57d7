"""Optimizers: the factory behind ``fuser.compile`` and the built-ins (drop-ins for
torch.optim, same keywords and state_dict keys)."""

from fuser.optim.builtins import (
    CAME,
    LAMB,
    LARS,
    SGD,
    Adafactor,
    Adagrad,
    Adam,
    AdamW,
    Adan,
    AdEMAMix,
    Lion,
    Muon,
    NAdam,
    NorMuon,
    RAdam,
    RMSprop,
    ScheduleFreeAdamW,
    Shampoo,
)
from fuser.optim.factory import FuserOptimizer, kernel_sources, make_optimizer

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
    "Lion",
    "Muon",
    "NAdam",
    "NorMuon",
    "RAdam",
    "RMSprop",
    "ScheduleFreeAdamW",
    "Shampoo",
    "FuserOptimizer",
    "kernel_sources",
    "make_optimizer",
]
