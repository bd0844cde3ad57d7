"""Lowering: ``Rule`` -> kernel plans (CSE, hoisting, dtypes).

- ``optim.py``: ``lower_optim(rule, dtypes) -> OptimPlan`` (phases, reductions, slots; the
  storage formats of states, ``QFORMATS``, checked by ``check_compressed``).
- ``stores.py``: moves an fp32 element state's store to the first phase that can compute
  it, where that saves later phases their loads.
- ``loss.py``: ``lower_loss(rule) -> LossPlan`` (the derived gradient, the passes).
"""

from fuser.ir.optim import DTYPES, OptimPlan, Slot, lower_optim

__all__ = ["DTYPES", "OptimPlan", "Slot", "lower_optim"]
