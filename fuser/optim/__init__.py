"""Optimizers: the factory behind ``fuser.compile`` and the built-ins (drop-ins for
torch.optim, same keywords and state_dict keys)."""

from fuser.optim.builtins import AdamW
from fuser.optim.factory import FuserOptimizer, kernel_sources, make_optimizer

__all__ = ["AdamW", "FuserOptimizer", "kernel_sources", "make_optimizer"]
