"""Execution of a compiled loss: the chunked row-kernel driver and the autograd
``Function`` (``chunked``), the staged schedules (``staged``), and the choice of a call's
schedule, tiles and kernels (``choice``: ``choose(LossCall) -> SchedulePlan``, pure).

It lives in ``runtime/`` beside the optimizer's engine because it is the same kind of work
(buffers, launches, collectives, autograd) and reads only cache and codegen types;
``fuser.losses`` keeps what a user calls.

- ``chunked.py``: ``LinearLoss`` takes the gradients in forward for bf16 and fp32
  ``mean``/``sum`` calls of ``chunks`` and ``scaled``, into ``main_grad`` only where
  the plan's ``in_forward`` says (an fp32 buffer that its backward adds), else in
  backward. Its backward scales them by ``grad_output`` with ``render_grad_scale``'s kernel
  (``templates/loss_grad_scale.py.jinja``) before it reads the scaled schedule's range flag.
  ``HostValue``: a device value copied for the host where the stream reaches it, so that a
  later read waits for that point only.
- ``staged.py``: the staged schedules.
- ``fused.py``: the lean schedule's matmul driver. Its forward takes ``TileSums`` (the
  scaled schedule's kernel without its ``E``, and that schedule's per-token kernels) for a
  rule of that form on one device without a bias, where ``choice`` says.
- ``scaled.py``: the scaled schedule. Its kernel stores ``exp(a(z) - a(z[y]))``, times
  ``a'(z)`` where ``a`` is not linear (a softcap; ``choice.scaled_tiles`` then
  takes narrower tiles), whose form ``codegen/loss_matmul.py``'s ``scaled_exp_form`` finds in
  the rule; every per-token value comes from generated kernels; gradients in forward, its
  range check read in ``LinearLoss.backward`` after the gradients' scaling is queued;
  ``memory="auto"`` picks it where ``choice`` finds it pays.
- ``residue.py``: the target column's residue. The gradient kernels of every other schedule
  write each token's target-column value less its 16-bit rounding; it is added to
  ``grad_hidden``, to ``grad_weight``'s row (the tokens sorted by target, ``KeyRuns``;
  ``TargetRows``, the kernels of ``codegen/loss_matmul.py``'s ``render_target_rows``,
  ``templates/loss_target_rows.py.jinja``, which the scaled schedule's target term also
  uses) and to ``grad_bias``, in fp32 before any rounding. A 16-bit ``grad_hidden`` passes
  through fp32 blocks for it; a 16-bit ``grad_weight`` slice takes its rows in
  ``WeightGrad``, the kernels of ``render_weight_grad`` (``templates/loss_weight_grad.py.jinja``:
  the target-row kernels write each target's residue row into it, then a persistent matmul
  through tensor descriptors adds those rows to ``dz.T @ hidden`` in fp32 and rounds once)
  where tensor descriptors pay and the slice has tiles for every processor twice, else
  through fp32 blocks (``SliceTerms``)."""
