"""Parsing and validation: rule text or a traced function -> ``Rule``."""

from fuser.rules.functions import Reduction
from fuser.rules.loss import loss
from fuser.rules.parse import Statement, symbol
from fuser.rules.rule import FUNCTIONS, REDUCTIONS, Rule, rule

__all__ = ["FUNCTIONS", "REDUCTIONS", "Reduction", "Rule", "Statement", "loss", "rule", "symbol"]
