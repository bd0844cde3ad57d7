"""Execution: the optimizer's step engine (``engine``, with ``plans``, ``tracking``, ``state``),
device pointer tables (``tables``), DTensor shards (``distributed``) and loss execution
(``loss``). See ARCHITECTURE.md.

- ``plans.py``: compile ``Options``, dtype plans, ``plan_and_sources(rule, dtypes) ->
  (StepLayout, [KernelSource])``, ``kernel_sources``; ``state_format`` picks a state's
  storage format.
- ``engine.py``: the ``StepEngine`` of an optimizer step (full check, rebuild, the program
  of launch steps, hyper rows, AMP).
- ``tracking.py``: the quick "nothing changed" check (``Snapshot``, noting state dicts).
- ``state.py``: state creation and checks (8-bit states' codes and scales, split masters'
  low parts), the scalar table, dequantized and labelled state dicts.
- ``quant.py``: the 8-bit codecs and split masters in torch, for state dicts.
- ``tables.py``: device pointer tables, and the 2-D views of tensors (``VIEWS``: ``flatten``,
  ``[shape[0], prod(rest)]``, or ``batched``, whose matrices of the last two dimensions are
  table rows of their own, ``engine.table_entries``; a ``CombineStep`` after a phase,
  ``engine.BatchCombine``, makes their per-tensor reductions of element values the whole
  tensor's).
- ``distributed.py``: DTensor shards and their collectives (per-tensor partials, and the
  partial row or column reductions of shards that split an axis), the row spans a matrix
  function gathers, the layout of row and column states of sharded tensors, and the
  per-shard layout of 8-bit scales in compressed state dicts.
- ``matrix.py``: matrix functions (``orthogonalize``): per-shape stacked buffers, the
  products of row-sharded DTensors' matrices divided between the ranks of their shard
  group (``Split``: a ``reduce_scatter`` and an ``all_gather`` per shape group), and their
  batched products (``newton_schulz``: fuser's two symmetric-product kernels and
  ``torch.bmm`` per iteration and shape group).
- ``loss/``: loss execution (its own docstring).
"""
