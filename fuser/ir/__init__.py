"""Lowering: ``Rule`` -> kernel plans (CSE, hoisting, dtypes)."""

from fuser.ir.optim import DTYPES, OptimPlan, Slot, lower_optim

__all__ = ["DTYPES", "OptimPlan", "Slot", "lower_optim"]
