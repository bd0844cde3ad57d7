"""Execution: the optimizer's step engine (``engine``, with ``plans``, ``tracking``, ``state``),
device pointer tables (``tables``), DTensor shards (``distributed``) and loss execution
(``loss``). See ARCHITECTURE.md."""
