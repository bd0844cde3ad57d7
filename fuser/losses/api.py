"""The callable a compiled loss rule becomes: argument checks, then ``ops.LinearLoss``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fuser.codegen.loss import DEFAULT_BLOCK, DEFAULT_WARPS, has_residue, render_loss, shard_layout
from fuser.codegen.loss_matmul import (
    WEIGHT_GRAD_TILES,
    Tiles,
    render_grad_scale,
    render_loss_matmul,
    render_loss_scaled,
    render_scaled_terms,
    render_scaled_tokens,
    render_target_gather,
    render_target_rows,
    render_weight_grad,
    scaled_exp_form,
    warp_specialized,
)
from fuser.codegen.source import KernelSource
from fuser.ir.loss import Z_Y, lower_loss
from fuser.losses import tokens
from fuser.losses.checks import check_tensors, live_rows
from fuser.rules.loss import is_token_rule, reads_teacher_target, teacher_target_as_input
from fuser.rules.rule import Rule
from fuser.runtime.loss.choice import (
    SCALED_DTYPES,
    SCHEDULES,
    LossCall,
    RuleForm,
    SchedulePlan,
    choose,
    rule_form,
    scaled_tiles,
    shard_chunk,
)
from fuser.runtime.loss.chunked import Chunked, LinearLoss
from fuser.runtime.loss.fused import Fused, TileSums
from fuser.runtime.loss.residue import Residue
from fuser.runtime.loss.scaled import ScaledExp, TokenValues
from fuser.runtime.loss.staged import ShardedChunked, Staged, forward_rows, vocab_cols
from fuser.runtime.loss.tokens import ShardedTokens, TokenRun, VocabTokens, token_chunk

REDUCTIONS = ("mean", "sum", "none")
MEMORY = ("auto", "lean", "fast")


class CompiledLoss:
    """A fused ``linear + loss`` with autograd, compiled from a loss rule.

        loss = f(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                 accumulate_into=None, process_group=None, memory="auto", **hyper_overrides)

    ``hidden`` is ``[T, H]`` or ``[B, S, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]``, all of
    one dtype (fp32, bf16 or fp16); ``target`` holds class indices in ``hidden``'s leading
    shape. ``reduction`` (``None`` is ``"mean"``): ``"mean"`` over targets other than
    ``ignore_index`` (0 when all are ignored), ``"sum"``, or ``"none"`` (one loss per token,
    0 where ignored). A rule with per-token inputs takes each by keyword, a tensor of
    ``target``'s shape; one with outputs other than ``("loss",)`` returns a tuple of them,
    fp32 of ``target``'s shape, and takes no ``reduction`` (``fuser.losses.tokens``). One
    that reads the teacher's logits ``t`` takes ``teacher_hidden=`` (``[T, H_t]``, in
    ``hidden``'s leading shape), ``teacher_weight=`` (``[V, H_t]``) and optionally
    ``teacher_bias=``, none of which gets a gradient. With
    ``accumulate_into="main_grad"`` the weight gradient is added into ``weight.main_grad``
    (fp32) instead of being returned (Megatron's contract). The loss is fp32 whatever the
    inputs' dtype, as ``F.cross_entropy`` of fp32 logits, Liger and Cut Cross-Entropy return
    it: computed in fp32, a bf16 loss would lose ~3 digits in every training log.

    ``memory`` picks the schedule: ``"lean"`` computes the logits tile by tile inside Triton
    matmul kernels that reduce them in registers (forward) or turn them into
    ``d loss / d logits`` (backward), so no ``[T, V]`` buffer exists, only a slice of the
    logit gradient. ``"fast"`` keeps a chunk (or all) of the logits in memory and takes the gradients in
    forward where it can, into ``main_grad`` too: the weight's into an fp32 ``[V, H]`` buffer
    that backward adds into ``main_grad`` times ``grad_output`` (``"auto"`` and ``"lean"``
    add into ``main_grad`` in backward, with no buffer). ``"auto"`` picks by the sizes (the
    compile option ``schedule``, when not ``"auto"``, names one schedule instead). fp16
    inputs take every gradient in backward, scaled by ``grad_output`` before its rounding
    to fp16 (as a loss scale, ``torch.amp.GradScaler``'s, expects; ``schedule="scaled"``
    refuses them).

    With ``process_group=pg`` the loss is vocabulary-parallel (Megatron's layout): ``weight``
    (and ``bias``) are this rank's contiguous slice of the vocabulary, the ranks' slices in
    rank order (sizes may differ), while ``hidden`` and ``target`` (global class indices) are
    the same on every rank. Every vocabulary reduction of the rule is combined across the
    group; each rank gets the full loss, the gradient of ``hidden`` summed over the group, and
    the gradients of its own ``weight``/``bias`` slice; ``memory="lean"`` runs the matmul
    kernels over each rank's rows, any other runs row kernels over chunks of tokens.

    Rows whose target is ``ignore_index`` are left out of every kernel, matmul and
    collective; finding them reads their count on the host, once per call. The same read
    checks the other targets: one outside ``[0, V)`` (with ``process_group``, ``V`` is the
    global vocabulary, the sum of the ranks' slices) raises a ``ValueError`` that names the
    first such position (in ``target``'s shape), its value and ``V``, before any kernel runs
    or any gradient or ``main_grad`` is written. That host read is why a call cannot be
    captured in a CUDA graph: inside a capture it raises a ``RuntimeError`` saying so. A
    strided ``hidden``, ``weight`` or ``bias`` is copied to a contiguous one first; with
    ``accumulate_into="main_grad"``, ``weight`` and its ``main_grad`` must be contiguous.
    """

    def __init__(
        self,
        rule: Rule,
        *,
        chunk_size: int | None = None,
        block: int = DEFAULT_BLOCK,
        num_warps: int = DEFAULT_WARPS,
        schedule: str = "auto",
        tiles: Tiles | None = None,
    ):
        if rule.kind != "loss":
            raise TypeError(f"a loss needs a loss rule (fuser.loss), not a {rule.kind} rule")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int, not {chunk_size!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
        if tiles is not None and not isinstance(tiles, Tiles):
            raise TypeError(f"tiles must be a fuser.codegen.loss_matmul.Tiles, not {type(tiles).__name__}")
        self.schedule = schedule
        self.tiles = tiles
        self.rule = rule
        self.hyper_defaults = dict(rule.hyper)
        self.chunk_size = chunk_size
        self.block = block
        self.num_warps = num_warps
        self._sources: dict[str, KernelSource] = {}
        self._sharded: dict[str, tuple] = {}
        self._matmul: dict[tuple, tuple] = {}
        self._forms: dict[str, RuleForm] = {}
        self._scaled: dict[tuple, KernelSource | tuple | None] = {}
        self._token_values: dict[str, TokenValues] = {}
        self._shard_sizes: dict[tuple, tuple[int, ...]] = {}
        self._hyper_rows: dict[tuple, torch.Tensor] = {}
        self._target_input: CompiledLoss | None = None
        self.__name__ = rule.name
        self.__doc__ = f"Fused linear + loss `{rule.name}`:\n\n{rule.text}\n\n{CompiledLoss.__doc__}"

    def kernel_source(self, dtype: str = "bf16") -> KernelSource:
        """The row kernel for logits of ``dtype`` (``fp32``, ``bf16``, ``fp16``). Calls of every
        dtype launch fp32's (``row_source``: their logits are accumulated and kept in fp32);
        a token rule's is fp32's whatever ``dtype``."""
        if is_token_rule(self.rule):
            dtype = "fp32"
        if dtype not in self._sources:
            self._sources[dtype] = render_loss(
                lower_loss(self.rule, dtype), block=self.block, num_warps=self.num_warps
            )
        return self._sources[dtype]

    def sharded_kernel_sources(self, dtype: str = "bf16") -> tuple:
        """(sources, layout, zy_first) of the staged launch sequence for logits of ``dtype``:
        one kernel per reduction pass, then the loss and gradient kernel. The schedules that
        keep logits in memory launch fp32's for every dtype; ``fused`` and ``scaled`` launch
        the last kernel of their inputs' dtype on the reductions alone."""
        if dtype not in self._sharded:
            plan = lower_loss(self.rule, dtype)
            sources = tuple(
                render_loss(plan, block=self.block, num_warps=self.num_warps, stage=k)
                for k in range(len(plan.passes) + 1)
            )
            first = plan.passes[0] if plan.passes else None
            reads_zy = first is None or any(
                Z_Y in e.free_symbols
                for e in [e for _, e in first.prologue + first.body] + [a.arg for a in first.accumulators]
            )
            self._sharded[dtype] = (sources, shard_layout(plan), reads_zy)
        return self._sharded[dtype]

    def matmul_kernel_sources(
        self,
        dtype: str = "bf16",
        tiles: Tiles | None = None,
        *,
        grad_tiles: Tiles | None = None,
        has_bias=False,
    ):
        """(sweeps, gradient) kernels of the lean schedule for ``dtype``: one sweep per
        reduction pass, then the kernel that forms the logit gradient tile by tile. Block
        shapes: ``tiles`` and ``grad_tiles``, else the compile option ``tiles`` for both,
        else the GPU defaults (``Tiles()`` for ``dtype``; ``gradient_tiles`` for the gradient)."""
        tiles = tiles or self.tiles or Tiles().for_dtype(dtype)
        grad_tiles = grad_tiles or self.tiles or self._gradient_tiles(dtype)
        key = (dtype, tiles, grad_tiles, has_bias)
        if key not in self._matmul:
            plan = lower_loss(self.rule, dtype)
            sweeps = tuple(
                render_loss_matmul(plan, tiles, stage=k, has_bias=has_bias) for k in range(len(plan.passes))
            )
            self._matmul[key] = (sweeps, render_loss_matmul(plan, grad_tiles, has_bias=has_bias))
        return self._matmul[key]

    def scaled_kernel_source(self, dtype: str = "bf16", tiles: Tiles | None = None) -> KernelSource | None:
        """The scaled schedule's matmul kernel for ``dtype`` (tiles: ``tiles``, else the compile
        option ``tiles``, else ``scaled_tiles`` without descriptors), or ``None`` for a rule
        whose gradient has no scaled-exponential form (``scaled_exp_form``)."""
        tiles = tiles or self.tiles or self._scaled_tiles(dtype, False)
        key = (dtype, tiles)
        if key not in self._scaled:
            plan = lower_loss(self.rule, dtype)
            self._scaled[key] = render_loss_scaled(plan, tiles) if scaled_exp_form(plan) else None
        return self._scaled[key]

    def tile_sums_sources(self, dtype: str = "bf16", tiles: Tiles | None = None) -> tuple | None:
        """The lean schedule's forward kernels for ``dtype`` where the rule's gradient has a
        scaled-exponential form (else ``None``): the scaled kernel without ``E``
        (``render_loss_scaled(store_e=False)``; tiles: ``tiles``, else the compile option
        ``tiles``, else ``scaled_tiles`` without descriptors, never narrow: with no ``E`` there
        is no ``a'(z)`` beside the tile), then the scaled schedule's prepare and tokens kernels."""
        tiles = tiles or self.tiles or scaled_tiles(dtype, False)
        key = ("tile_sums", dtype, tiles)
        if key not in self._scaled:
            plan = lower_loss(self.rule, dtype)
            tokens = self.scaled_token_sources(dtype)
            self._scaled[key] = (
                None if tokens is None else (render_loss_scaled(plan, tiles, store_e=False), *tokens[:2])
            )
        return self._scaled[key]

    def _scaled_tiles(self, dtype: str, tma: bool) -> Tiles:
        """``scaled_tiles`` for this rule: narrow where its ``E`` carries ``a'(z)``."""
        return scaled_tiles(dtype, tma, self._form(dtype).narrow)

    def _form(self, dtype: str) -> RuleForm:
        """What the schedule's choice reads of this rule for ``dtype`` (``rule_form``)."""
        if dtype not in self._forms:
            self._forms[dtype] = rule_form(self.rule.name, lower_loss(self.rule, dtype))
        return self._forms[dtype]

    def scaled_token_sources(self, dtype: str = "bf16") -> tuple[KernelSource, ...] | None:
        """The scaled schedule's kernels around its matmul kernel for ``dtype``: the per-call
        and per-chunk token kernels (``render_scaled_tokens``), then the three gradient-term
        kernels (``render_scaled_terms``); ``None`` where the rule has no scaled-exponential
        form."""
        key = ("tokens", dtype)
        if key not in self._scaled:
            plan = lower_loss(self.rule, dtype)
            form = scaled_exp_form(plan)
            self._scaled[key] = (
                None
                if form is None
                else (
                    *render_scaled_tokens(plan),
                    *render_scaled_terms(dtype, has_target=form.target != 0, has_const=form.const != 0),
                )
            )
        return self._scaled[key]

    def residue_sources(self, dtype: str = "bf16") -> tuple[KernelSource, ...]:
        """The kernels that add the target column's residue where ``dtype``'s gradient
        kernels write one (``has_residue``; else none): the two that add it to fp32 rows of
        ``grad_weight`` (``render_target_rows``), then the one that adds it to ``grad_hidden``
        (``render_target_gather``)."""
        key = ("residue", dtype)
        if key not in self._scaled:
            keep = has_residue(lower_loss(self.rule, dtype))
            self._scaled[key] = (*render_target_rows(dtype), render_target_gather(dtype)) if keep else ()
        return self._scaled[key]

    def weight_grad_sources(self, dtype: str, tiles: Tiles | None = None) -> tuple[KernelSource, ...]:
        """The kernels that write a 16-bit ``grad_weight`` with the target column's residue
        rows in it (``render_weight_grad``; ``tiles``: the product's block shape, else the
        GPU's), where ``dtype``'s gradient kernels write a residue; else none."""
        key = ("weight_grad", dtype, tiles)
        if key not in self._scaled:
            keep = bool(self.residue_sources(dtype))
            self._scaled[key] = render_weight_grad(dtype, tiles or WEIGHT_GRAD_TILES) if keep else ()
        return self._scaled[key]

    def _residue(self, call: _Call, plan: SchedulePlan) -> Residue | None:
        """What a call's run needs to add the target column's residue (``plan.residue``), or
        ``None``; a 16-bit ``grad_weight`` takes its rows in the weight-gradient kernel of
        ``plan.weight_grad``'s tiles, else through fp32 blocks (``residue.SliceTerms``)."""
        if not plan.residue:
            return None
        weight_grad = None
        if plan.weight_grad is not None:
            weight_grad = self.weight_grad_sources(call.dtype, plan.weight_grad)
        return Residue(self.residue_sources(call.dtype), call.device, call.ignore_index, weight_grad)

    def _gradient_tiles(self, dtype: str, tma: bool = False) -> Tiles:
        """The lean gradient kernel's GPU tiles (``gradient_tiles``; ``tma``: where tensor
        descriptors are TMA)."""
        form = self._form(dtype)
        return form.grad_tiles_tma if tma else form.grad_tiles

    def _shard_sizes_of(self, group, local: int, device: torch.device) -> tuple[int, ...]:
        """Every rank's vocabulary slice length, gathered once per (group, local length)."""
        import torch.distributed as dist

        key = (id(group), local, device.type)
        sizes = self._shard_sizes.get(key)
        if sizes is None:
            world = dist.get_world_size(group)
            mine = torch.tensor([local], dtype=torch.int64, device=device)
            out = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(out, mine, group=group)
            sizes = tuple(int(t.item()) for t in out)
            self._shard_sizes[key] = sizes
        return sizes

    @property
    def source(self) -> str:
        """The generated Triton source of the row kernel (fp32 logits, which calls of every
        dtype launch), as text."""
        return self.row_source().text

    def _hyper_row(self, overrides: dict, device: torch.device) -> torch.Tensor:
        unknown = set(overrides) - set(self.hyper_defaults)
        if unknown:
            known = ", ".join(self.hyper_defaults) or "none"
            raise TypeError(
                f"{self.rule.name}() got unexpected keyword argument(s) {sorted(unknown)} "
                f"(its hyperparameters: {known})"
            )
        values = []
        for name, default in self.hyper_defaults.items():
            v = float(overrides.get(name, default))
            if not math.isfinite(v):
                raise ValueError(f"hyperparameter {name!r} must be finite, not {v}")
            values.append(v)
        key = (str(device), tuple(values))
        row = self._hyper_rows.get(key)
        if row is None:
            # One fp32 row per distinct setting, kept on the device: no copy per call.
            row = torch.tensor(values or [0.0], dtype=torch.float32, device=device)
            if len(self._hyper_rows) > 64:
                self._hyper_rows.clear()
            self._hyper_rows[key] = row
        return row

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str | None = None,
        accumulate_into: str | None = None,
        process_group=None,
        memory: str = "auto",
        teacher_hidden: torch.Tensor | None = None,
        teacher_weight: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        **hyper_overrides,
    ) -> torch.Tensor:
        token = is_token_rule(self.rule)
        teacher = (teacher_hidden, teacher_weight, teacher_bias)
        if token:
            inputs, hyper_overrides = tokens.split_keywords(self.rule, hyper_overrides)
            tokens.check_options(self.rule, self.schedule, memory, reduction, process_group)
        elif any(t is not None for t in teacher):
            tokens.teacher_tensors(self.rule, hidden, weight, *teacher, process_group)  # (raises)
        reduction = "mean" if reduction is None else reduction
        dtype = _check_call(hidden, weight, target, bias, reduction, accumulate_into)
        if token:
            teacher = tokens.teacher_tensors(self.rule, hidden, weight, *teacher, process_group)
        if memory not in MEMORY:
            raise ValueError(f"memory must be one of {MEMORY}, not {memory!r}")
        if memory != "auto" and self.schedule != "auto":
            raise ValueError(
                f"memory={memory!r} picks a schedule, and this loss was compiled with "
                f"schedule={self.schedule!r}: give one or the other"
            )
        main_grad = accumulate_into == "main_grad"
        x = hidden.reshape(-1, hidden.shape[-1])
        y = target.reshape(-1).to(torch.int64).contiguous()
        call = _Call(
            dtype=dtype,
            device=hidden.device,
            hyper=self._hyper_row(hyper_overrides, hidden.device),
            ignore_index=ignore_index,
            n_tokens=x.shape[0],
            hid=x.shape[1],
            vocab=weight.shape[0],
            es=hidden.element_size(),
        )
        want_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias)
        )
        if token:
            keywords = dict(main_grad=main_grad, want_grad=want_grad, group=process_group, teacher=teacher)
            return self._token_call(call, x, weight, bias, y, inputs, target, reduction, memory, **keywords)
        out = self._run_call(
            call, x, weight, bias, y, memory, reduction, main_grad, want_grad, process_group, target.shape
        )
        if reduction == "none":
            out = out.reshape(hidden.shape[:-1])
        return out

    def row_source(self) -> KernelSource:
        """The row kernel every call launches (``chunks``): fp32 logits for every dtype."""
        return self.kernel_source("fp32")

    def token_source(self) -> KernelSource:
        """A token rule's row kernel: fp32 logits whatever the inputs' dtype (the logits of
        its calls accumulate and stay in fp32)."""
        return self.kernel_source("fp32")

    def token_residue_sources(self, dtype: str) -> tuple[KernelSource, ...]:
        """The kernels a token rule's ``memory="lean"`` backward adds the target column's
        residue with, for 16-bit ``dtype`` (``residue_sources``' three); none for fp32."""
        if dtype == "fp32":
            return ()
        return (*render_target_rows(dtype), render_target_gather(dtype))

    def _token_call(
        self, call: _Call, x, weight, bias, y, inputs, target, reduction, memory, *, main_grad, want_grad,
        group, teacher=None,
    ):  # fmt: skip
        """A token rule's call (``fuser.losses.tokens``): its outputs as a tuple of fp32
        tensors of ``target``'s shape, or, for a rule whose one output is ``loss``, that
        loss reduced by ``reduction`` (``"mean"``: over the targets not ignored); with
        ``group``, over this rank's vocabulary slice; ``teacher``: the teacher's ``(hidden,
        weight, bias)`` for a rule that reads ``t``."""
        rows = tokens.input_rows(self.rule, inputs, target, call.device)
        shards = None if group is None else self._vocab_slices(call, group)
        slices = None if shards is None else shards[0]
        f = self
        if reads_teacher_target(self.rule) and (memory == "lean" or shards is not None):
            f = self._target_input_loss()  # (t[y] to the staged kernels as a per-token input)
            offset = 0 if shards is None else sum(shards[0][: shards[1]])
            t_y = tokens.teacher_at_target(teacher, y, call.ignore_index, offset, group)
            rows = torch.cat([rows, t_y[None]])

        def count_rows(flat):
            vocab = call.vocab if slices is None else sum(slices)
            return live_rows(flat, call.ignore_index, vocab, target.shape, slices)

        def make_run(count: int):  # (the chunks of the global vocabulary's size: alike on every rank)
            chunk = token_chunk(
                count, call.hid, call.vocab if slices is None else sum(slices), self.chunk_size
            )
            if shards is None and memory == "lean":
                return f._vocab_tokens_run(call, count, teacher is not None)
            if shards is None:  # (memory="fast": every token's logits kept for backward)
                keep = memory == "fast"
                return TokenRun(self.token_source(), call.device, call.hyper, call.ignore_index, chunk, keep)
            sizes, rank = shards
            sources, layout, zy_first = f.sharded_kernel_sources("fp32")
            return ShardedTokens(
                sources, layout, zy_first, call.device, call.hyper, call.ignore_index, chunk, group,
                sum(sizes[:rank]), sum(sizes),
            )  # fmt: skip

        main_grad = main_grad and weight.requires_grad
        single = tuple(n for n, _ in self.rule.outputs) == ("loss",)
        # (gradients in forward, but with main_grad only under memory="fast": their fp32 [V, H]
        # buffer is what main_grad's users keep memory for)
        eager = single and memory != "lean" and (not main_grad or memory == "fast")
        outs, _ = tokens.run_token_rule(
            f.rule, x, weight, bias, y, rows, target.shape,
            main_grad=main_grad, want_grad=want_grad, count_rows=count_rows, make_run=make_run,
            teacher=teacher, reduction=reduction if single else "none", eager=eager,
        )  # fmt: skip
        return outs[0] if single else outs

    def _target_input_loss(self) -> CompiledLoss:
        """This loss with its rule's ``t[y]`` read as a per-token input
        (``teacher_target_as_input``), compiled with the same options, made once."""
        if self._target_input is None:
            self._target_input = CompiledLoss(
                teacher_target_as_input(self.rule), chunk_size=self.chunk_size, block=self.block,
                num_warps=self.num_warps, schedule=self.schedule, tiles=self.tiles,
            )  # fmt: skip
        return self._target_input

    def _vocab_tokens_run(self, call: _Call, count: int, teacher: bool) -> VocabTokens:
        """A token rule's run under ``memory="lean"``: forward chunks and backward slices
        sized as the ``vocab`` schedule's (the teacher's logits beside the student's count
        twice)."""
        size = 8 if teacher else 4  # (bytes of fp32 logits a column, the teacher's included)
        chunk = token_chunk(count, call.hid, call.vocab, None)
        chunk = self.chunk_size or min(chunk, forward_rows(call.vocab, size))
        cols = vocab_cols(count, call.hid, size, self.block)
        sources, layout, zy_first = self.sharded_kernel_sources("fp32")
        k = len(self.rule.outputs)
        run = VocabTokens(
            sources, layout, zy_first, call.device, call.hyper, call.ignore_index, chunk, k, cols
        )  # fmt: skip
        residue = self.token_residue_sources(call.dtype)
        run.residue = Residue(residue, call.device, call.ignore_index) if residue else None
        return run

    def _run_call(
        self, call: _Call, x, weight, bias, y, memory, reduction, main_grad, want_grad, group, shape
    ):
        """Rows whose target is ``ignore_index`` are left out of every kernel, matmul and
        collective (finding them reads their count on the host, once per call; every rank
        of ``group`` holds the same targets, so all leave out the same rows): their loss and
        their ``grad_hidden`` are 0. The count of the others is the mean's denominator. Then
        the run of the plan ``choose`` gives runs."""
        n = y.shape[0]
        shards = None if group is None else self._vocab_slices(call, group)
        slices = None if shards is None else shards[0]
        vocab = call.vocab if group is None else sum(slices)  # (targets are global indices)
        idx, count = live_rows(y, call.ignore_index, vocab, shape, slices)  # (the one host read)
        if idx is not None:
            x, y = x.index_select(0, idx), y.index_select(0, idx)
            call = replace(call, n_tokens=count)
        x, weight = x.contiguous(), weight.contiguous()  # (the kernels take rows H elements apart)
        bias = bias.contiguous() if bias is not None else None
        main_grad = main_grad and weight.requires_grad
        keywords = dict(reduction=reduction, memory=memory, main_grad=main_grad, want_grad=want_grad)
        loss_call = self._loss_call(call, x, weight, bias, group=group, **keywords)
        plan = choose(loss_call)
        if plan.schedule == "fused":
            run = self._fused_run(call, plan, x, weight, bias, group, shards)
        elif plan.schedule == "scaled":
            run = self._scaled_run(call, plan)
        elif group is not None:
            run = self._vocab_parallel_run(call, loss_call, plan, group, shards)
        else:
            run = self._one_device_run(call, plan)
        eager = plan.in_forward
        out = LinearLoss.apply(x, weight, bias, y, run, reduction, main_grad, want_grad, eager, count)
        if call.n_tokens < n and reduction == "none":
            out = torch.zeros(n, dtype=out.dtype, device=out.device).index_copy(0, idx, out)
        return out

    def _loss_call(
        self, call: _Call, x, weight, bias=None, *, reduction="mean", memory="auto", main_grad=False,
        want_grad=True, group=None,
    ) -> LossCall:  # fmt: skip
        """What ``choose`` reads of a call: its sizes and keywords, the device's kind and
        capability, the compile options and the rule's form for its dtype."""
        cuda = call.device.type == "cuda"
        return LossCall(
            dtype=call.dtype,
            n_tokens=call.n_tokens,
            hidden=call.hid,
            vocab=call.vocab,
            form=self._form(call.dtype),
            device=call.device.type,
            capability=torch.cuda.get_device_capability(call.device) if cuda else None,
            reduction=reduction,
            bias=bias is not None,
            main_grad=main_grad,
            want_grad=want_grad,
            vocab_parallel=group is not None,
            memory=memory,
            schedule=self.schedule,
            chunk_size=self.chunk_size,
            block=self.block,
            tiles=self.tiles,
            # (what contiguous() copies is a fresh allocation, which torch aligns to 64 bytes or more)
            aligned=all(t.data_ptr() % 16 == 0 for t in (x, weight) if t.is_contiguous()),
        )

    def _one_device_run(self, call: _Call, plan: SchedulePlan):
        """The run of a one-device call with logits in memory: row kernels over chunks of
        tokens, or a staged schedule."""
        if plan.schedule == "chunks":
            return self._row_run(call, plan)
        sources, layout, zy_first = self.sharded_kernel_sources("fp32")  # (fp32 logits)
        run = Staged(sources, layout, zy_first, call.device, call.hyper, call.ignore_index, plan.chunk)
        run.schedule, run.cols = plan.schedule, plan.cols
        run.residue = self._residue(call, plan)
        return run

    def _row_run(self, call: _Call, plan: SchedulePlan) -> Chunked:
        """The row kernel over chunks of ``plan.chunk`` tokens."""
        run = Chunked(self.row_source(), call.device, call.hyper, call.ignore_index, plan.chunk)
        run.residue = self._residue(call, plan)
        return run

    def _scaled_run(self, call: _Call, plan: SchedulePlan) -> ScaledExp:
        """The scaled schedule's run, with the row kernel's as its fallback (built if a call
        needs it)."""
        sources = self.sharded_kernel_sources(call.dtype)[0]

        def fallback() -> Chunked:  # (fp32 logits: in E's bytes, fewer tokens a chunk)
            return self._row_run(call, replace(plan, chunk=max(1, plan.chunk * call.es // 4)))

        kernels = (self.scaled_kernel_source(call.dtype, plan.tiles), *self.scaled_token_sources(call.dtype))
        return ScaledExp(
            kernels, sources[-1], self._values(call.dtype), plan.tiles, call.device, call.hyper,
            call.ignore_index, plan.chunk, fallback,
        )  # fmt: skip

    def _values(self, dtype: str) -> TokenValues:
        """The scaled form's ``TokenValues`` for ``dtype`` (a rule that has the form)."""
        if dtype not in self._token_values:
            plan = lower_loss(self.rule, dtype)
            self._token_values[dtype] = TokenValues(plan, scaled_exp_form(plan), shard_layout(plan))
        return self._token_values[dtype]

    def _fused_run(self, call: _Call, plan: SchedulePlan, x, weight, bias, group=None, shards=None) -> Fused:
        """The lean schedule's run: matmul kernels of the plan's tiles for this device, hidden
        size and bias; with ``group``, over this rank's slice of the vocabulary (``shards``:
        ``_vocab_slices``'s sizes and rank)."""
        sweeps, grad = self.matmul_kernel_sources(
            call.dtype, plan.tiles, grad_tiles=plan.grad_tiles, has_bias=bias is not None
        )
        sources, layout, _ = self.sharded_kernel_sources(call.dtype)
        kernels = (sweeps, grad, sources[-1])
        tile_sums = None
        if plan.tile_sums is not None:
            sums = self.tile_sums_sources(call.dtype, plan.tile_sums)
            tile_sums = TileSums(sums, self._values(call.dtype), plan.tile_sums, call.device)
        tiles = (plan.tiles, plan.grad_tiles)
        run = Fused(kernels, layout, tiles, call.device, call.hyper, call.ignore_index, plan.cols, tile_sums)
        run.residue = self._residue(call, plan)
        if group is not None:
            run.shard(group, *shards)
        return run

    def _shards(self, call: _Call, group) -> tuple[tuple[int, ...], int]:
        """Every rank's vocabulary slice length and this rank's index in ``group``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "process_group= (a vocabulary-parallel loss) needs torch.distributed "
                "initialised (init_process_group)"
            )
        return self._shard_sizes_of(group, call.vocab, call.device), dist.get_rank(group)

    def _vocab_slices(self, call: _Call, group) -> tuple[tuple[int, ...], int]:
        """Every rank's vocabulary slice length (their sum bounds the targets) and this
        rank's index, for a schedule that runs with ``group``."""
        if self.schedule in ("whole", "vocab", "scaled"):
            raise ValueError(
                f"schedule={self.schedule!r} is for one device; a vocabulary-parallel loss "
                "(process_group=) runs in chunks of tokens, or with memory='lean' in the matmul kernels"
            )
        return self._shards(call, group)

    def _vocab_parallel_run(
        self, call: _Call, loss_call: LossCall, plan: SchedulePlan, group, shards
    ) -> ShardedChunked:
        """The run of a call with ``process_group=``: this rank's vocabulary slice, in chunks
        of tokens that every rank runs alike (``shard_chunk``); ``shards`` is
        ``_vocab_slices``'s (sizes, rank)."""
        sizes, rank = shards
        sources, layout, zy_first = self.sharded_kernel_sources("fp32")  # (fp32 logits)
        run = ShardedChunked(
            sources,
            layout,
            zy_first,
            call.device,
            call.hyper,
            call.ignore_index,
            shard_chunk(loss_call, sizes),
            group,
            sum(sizes[:rank]),
            sum(sizes),
        )
        run.residue = self._residue(call, plan)
        return run

    def __repr__(self) -> str:
        return f"<fuser compiled loss {self.rule.name!r}>"

    def _repr_html_(self) -> str:
        """Jupyter shows a compiled loss as its generated Triton source."""
        from fuser.display import loss_html

        return loss_html(self)


@dataclass(frozen=True)
class _Call:
    """What a call's run is built from besides the tensors: the inputs' dtype name and
    device, the hyperparameter row, and the sizes that choose chunks and schedules."""

    dtype: str
    device: torch.device
    hyper: torch.Tensor
    ignore_index: int
    n_tokens: int
    hid: int
    vocab: int
    es: int  # bytes per element of hidden


def _check_call(hidden, weight, target, bias, reduction: str, accumulate_into: str | None) -> str:
    """The inputs' dtype name, after raising the error of the first argument of a call
    that is out of contract (``checks.check_tensors``: the tensors)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")
    if accumulate_into not in (None, "main_grad"):
        raise ValueError(f"accumulate_into must be None or 'main_grad', not {accumulate_into!r}")
    return check_tensors(hidden, weight, target, bias, accumulate_into)


def make_loss(rule: Rule, **options) -> CompiledLoss:
    """``fuser.compile`` for loss rules. Options: ``chunk_size`` (tokens per chunk; by default
    chosen from H and V), ``block`` (vocabulary columns per kernel step), ``num_warps``,
    ``schedule`` (``"auto"``, ``"chunks"``, ``"whole"``, ``"vocab"``, ``"fused"`` or
    ``"scaled"``: see ``fuser.runtime.loss.staged``, ``fuser.runtime.loss.fused`` and
    ``fuser.runtime.loss.scaled``; ``auto`` lets each call's ``memory=`` pick, ``scaled``
    where ``fuser.runtime.loss.choice.choose`` finds it pays), ``tiles``
    (``fuser.codegen.loss_matmul.Tiles``: block shape of the matmul kernels)."""
    return CompiledLoss(rule, **options)


def grad_scale_sources(dtype: str) -> list[KernelSource]:
    """The kernels that multiply the gradients a forward took (``chunks`` and ``scaled``, not
    for fp16 inputs) by ``grad_output`` in backward, for ``dtype`` inputs: ``grad_weight``
    and ``grad_bias`` from fp32 into ``dtype``, ``grad_hidden`` in place (none for fp32,
    which torch scales in place, nor fp16)."""
    return [render_grad_scale("fp32", dtype), render_grad_scale(dtype, dtype)] if dtype == "bf16" else []


def _staged_sources(f: CompiledLoss, dtype: str) -> list[KernelSource]:
    """The staged sequence for fp32 logits (every dtype's), and for 16-bit ``dtype`` the last
    kernel of its own, which ``fused`` and ``scaled`` launch on the reductions."""
    staged = list(f.sharded_kernel_sources("fp32")[0])
    return staged if dtype == "fp32" else [*staged, f.sharded_kernel_sources(dtype)[0][-1]]


def kernel_sources(
    rule: Rule, dtype: str = "bf16", *, vocab_parallel: bool = False, **options
) -> list[KernelSource]:
    """Every kernel a compiled ``rule`` launches for inputs of ``dtype``: the row kernel and
    the staged sequences (``_staged_sources``: ``process_group=``, ``whole``, ``vocab``, and
    ``fused`` and ``scaled`` on the reductions), the lean schedule's matmul kernels (with, for
    a rule whose gradient has the scaled form and whose pass calls no function but ``exp``
    and ``approx_tanh`` (``tile_sums_pay``), its forward's tile-sums kernel: in ``tiles``,
    or through descriptors and warp-specialised where those allow it, for 16-bit inputs; and
    for fp16 the two per-token kernels around it) and the
    scaled schedule's, where the rule has one and ``dtype`` is not fp16, which the scaled
    schedule refuses (GPU tiles, no bias, a hidden size that is a
    multiple of their ``bk``; the lean schedule's gradient kernel and the scaled kernel
    also with tensor descriptors, where they take them (16-bit inputs; for the gradient
    kernel, rules whose gradient calls only exp and approx_tanh) and ``tiles`` is not given,
    and then again warp-specialised where their tiles allow it (``warp_specialized``: what
    sm_90 takes at small hidden sizes);
    then the scaled schedule's per-token and gradient-term kernels), then the kernels
    that add the target column's residue (``residue_sources``: 16-bit inputs) and, where
    ``tiles`` is not given, those that write a 16-bit ``grad_weight`` with it on sm_90
    (``weight_grad_sources``), and last those that scale a forward's gradients by
    ``grad_output`` (``grad_scale_sources``: bf16); with ``vocab_parallel=True``, those a
    call with ``process_group=`` launches: the staged sequence, the lean schedule's kernels,
    the residue's and the gradients' scaling. A token rule (per-token inputs, several
    outputs) launches the row kernel and the staged sequence (``process_group=``, ``lean``) of
    its fp32 plan whatever ``dtype``, and for 16-bit ``dtype`` ``token_residue_sources``."""
    f = CompiledLoss(rule, **options)
    if is_token_rule(rule):  # (a token rule's kernels take fp32 logits for every dtype)
        staged = f._target_input_loss() if reads_teacher_target(rule) else f  # (t[y] as an input there)
        return [f.token_source(), *staged.sharded_kernel_sources("fp32")[0], *f.token_residue_sources(dtype)]
    staged = _staged_sources(f, dtype)
    sweeps, grad = f.matmul_kernel_sources(dtype)
    lean = [*sweeps, grad]
    if f.tiles is None:  # (sm_90 takes the gradient kernel with descriptors: descriptors_pay)
        tma_tiles = f._gradient_tiles(dtype, True)
        for t in dict.fromkeys((tma_tiles, warp_specialized(tma_tiles))):
            tma = f.matmul_kernel_sources(dtype, grad_tiles=t)[1]
            lean += [tma] if tma.digest != grad.digest else []
    residue = list(f.residue_sources(dtype))
    if residue and f.tiles is None:  # (sm_90 writes a 16-bit grad_weight with it: descriptors_pay)
        residue += f.weight_grad_sources(dtype)
    residue += grad_scale_sources(dtype)
    if vocab_parallel:
        return [*staged, *lean, *residue]
    tokens = f.scaled_token_sources(dtype)
    if f._form(dtype).tile_sums and (f.tiles is not None or dtype != "fp32"):  # (choice's _tile_sums)
        tma_tiles = scaled_tiles(dtype, True)
        variants = dict.fromkeys((tma_tiles, warp_specialized(tma_tiles))) if f.tiles is None else (f.tiles,)
        lean += [f.tile_sums_sources(dtype, t)[0] for t in variants]
        lean += [] if dtype in SCALED_DTYPES else list(tokens[:2])  # (else listed with the scaled kernels)
    scaled = f.scaled_kernel_source(dtype) if dtype in SCALED_DTYPES else None
    scaled = [scaled] if scaled else []
    if scaled and f.tiles is None:  # (sm_90 takes it with descriptors: descriptors_pay)
        tma_tiles = f._scaled_tiles(dtype, True)
        for t in dict.fromkeys((tma_tiles, warp_specialized(tma_tiles))):
            tma = f.scaled_kernel_source(dtype, t)
            scaled += [tma] if tma.digest != scaled[0].digest else []
    scaled += list(f.scaled_token_sources(dtype)) if scaled else []
    return [f.row_source(), *staged, *lean, *scaled, *residue]
