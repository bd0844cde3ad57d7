"""Optimizers: the factory behind ``fuser.compile`` and the built-ins."""

from fuser.optim.factory import FuserOptimizer, kernel_sources, make_optimizer

__all__ = ["FuserOptimizer", "kernel_sources", "make_optimizer"]
