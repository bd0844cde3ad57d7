"""Parsing and validation: rule text or a traced function -> ``Rule``.

- ``rule.py``: ``fuser.rule``, an optimizer rule; ``loss.py``: ``fuser.loss``, a loss
  epilogue; ``parse.py``: the ``ast`` walker (a whitelist) both use.
- ``functions.py``: the functions a rule may call: elementwise, reductions, axis
  reductions and matrix functions (``MatrixFunction``, e.g. ``orthogonalize``); optimizer
  rules' own ``every(k)``, ``rand()``, ``randn()``; the constant ``pi``.
- ``shapes.py``: what each value holds per tensor: one number, one per row or column, one
  per element.
- ``signs.py``: which states a rule keeps non-negative, for unsigned 8-bit storage.
"""

from fuser.rules.functions import Reduction
from fuser.rules.loss import loss
from fuser.rules.parse import Statement, symbol
from fuser.rules.rule import FUNCTIONS, REDUCTIONS, Rule, rule

__all__ = ["FUNCTIONS", "REDUCTIONS", "Reduction", "Rule", "Statement", "loss", "rule", "symbol"]
