"""The callable a compiled loss rule becomes: argument checks, then ``ops.LinearLoss``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fuser.codegen.loss import DEFAULT_BLOCK, DEFAULT_WARPS, has_residue, render_loss, shard_layout
from fuser.codegen.loss_matmul import (
    WEIGHT_GRAD_TILES,
    Tiles,
    gradient_tiles,
    render_grad_scale,
    render_loss_matmul,
    render_loss_scaled,
    render_scaled_terms,
    render_scaled_tokens,
    render_target_gather,
    render_target_rows,
    render_weight_grad,
    scaled_exp_form,
    tile_sums_pay,
    warp_specialized,
)
from fuser.codegen.source import KernelSource
from fuser.ir.loss import Z_Y, lower_loss
from fuser.losses.checks import check_tensors, live_rows
from fuser.rules.rule import Rule
from fuser.runtime.loss.chunked import Chunked, LinearLoss, chunk_rows
from fuser.runtime.loss.fused import Fused, TileSums, slice_cols
from fuser.runtime.loss.residue import Residue
from fuser.runtime.loss.scaled import ScaledExp, TokenValues
from fuser.runtime.loss.staged import (
    MAIN_GRAD_BUDGET,
    SCHEDULES,
    ShardedChunked,
    Staged,
    choose_schedule,
    forward_rows,
    vocab_cols,
)

REDUCTIONS = ("mean", "sum", "none")
MEMORY = ("auto", "lean", "fast")

# Tiles of the matmul kernels in Triton's interpreter (CPU tensors): small, so that the
# small tensors of tests cross several tiles in every direction.
INTERPRETER_TILES = Tiles(bm=16, bn=32, bk=16, group_m=2, num_warps=4, num_stages=1)

# The scaled schedule's kernel on a GPU: row blocks in groups of 16 (H100, T=2304, H=768,
# V=128256: 0.93 ms against 1.02 ms in groups of 8).
SCALED_TILES = Tiles(group_m=16)
# The same through tensor descriptors, persistent (sm_90 and later, 16-bit inputs; H100, the
# kernel alone on one chunk: llama8b 7.47 -> 6.76 ms, gist 0.95 -> 0.97 ms; end to end,
# alternating processes: llama8b 47.3-47.8 -> 46.5-46.6 ms, gist 43.5-44.0 -> 43.0-43.4).
SCALED_TILES_TMA = Tiles(group_m=16, tma=True)
# The scaled kernel's tiles for a rule whose E carries a'(z) (a softcap's tanh, shared by
# a(z) and a'(z)): beside a [128, 256] fp32 tile its temporaries spill (sm_90, 8 warps: 255
# registers a thread and 200 bytes of stack; [128, 128]: 224 registers, no stack).
SCALED_TILES_NARROW = Tiles(bn=128, group_m=16)
SCALED_TILES_NARROW_TMA = Tiles(bn=128, group_m=16, tma=True)
# The input dtypes the scaled schedule takes (fp16: ``_scaled_refusal`` says why not), and
# those ``kernel_sources`` lists its kernels for.
SCALED_DTYPES = ("fp32", "bf16")
# The largest hidden size for which memory="auto" (or "fast") picks the scaled schedule over
# chunks of logits on sm_90 or later, for bf16 inputs (H100: faster at H = 768 and 2048, slower at
# 4096, where cuBLAS's logits matmul outruns the scaled kernel; benchmarks/NOTES.md).
SCALED_MAX_HIDDEN = 2048
# The largest hidden size for which memory="auto" picks the lean schedule over vocab for a
# weight gradient into main_grad, for 16-bit inputs (H100: 50.8 against 54.3 ms at T = 32768,
# H = 768; H200, bf16, since the lean forward takes the tile-sums kernel: T = 16384 at
# H = 2048, 56.3-57.3 against 60.4-61.2 ms; 8192 at 4096, 53.8-55.1 against 55.1-56.1;
# benchmarks/NOTES.md). Larger hidden sizes were not measured.
LEAN_MAIN_GRAD_MAX_HIDDEN = 4096
# The largest hidden size for which memory="auto" picks the lean schedule over chunks for
# fp16 inputs, which take their gradients in backward (H200, T = 32768, H = 768: 51.2-51.4
# against 54.0-57.3 ms; not measured at larger H).
LEAN_FP16_MAX_HIDDEN = 1024
# The largest hidden sizes for which the scaled kernel and the lean schedule's gradient
# kernel take warp-specialised programs on sm_90 (``warp_specialized``; H100, faster at
# H = 768 (both) and 2048 (the scaled kernel; the gradient kernel within the spread), slower
# at 4096; benchmarks/NOTES.md).
SCALED_WARP_SPECIALIZED_MAX_HIDDEN = 2048
GRAD_WARP_SPECIALIZED_MAX_HIDDEN = 1024


class CompiledLoss:
    """A fused ``linear + loss`` with autograd, compiled from a loss rule.

        loss = f(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                 accumulate_into=None, process_group=None, memory="auto", **hyper_overrides)

    ``hidden`` is ``[T, H]`` or ``[B, S, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]``, all of
    one dtype (fp32, bf16 or fp16); ``target`` holds class indices in ``hidden``'s leading
    shape. ``reduction``: ``"mean"`` over targets other than ``ignore_index`` (0 when all are
    ignored), ``"sum"``, or ``"none"`` (one loss per token, 0 where ignored). With
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
        self._grad_tiles: dict[tuple[str, bool], Tiles] = {}
        self._scaled: dict[tuple, KernelSource | tuple | None] = {}
        self._token_values: dict[str, TokenValues] = {}
        self._shard_sizes: dict[tuple, tuple[int, ...]] = {}
        self._hyper_rows: dict[tuple, torch.Tensor] = {}
        self.__name__ = rule.name
        self.__doc__ = f"Fused linear + loss `{rule.name}`:\n\n{rule.text}\n\n{CompiledLoss.__doc__}"

    def kernel_source(self, dtype: str = "bf16") -> KernelSource:
        """The row kernel launched for inputs of ``dtype`` (``fp32``, ``bf16``, ``fp16``)."""
        if dtype not in self._sources:
            self._sources[dtype] = render_loss(
                lower_loss(self.rule, dtype), block=self.block, num_warps=self.num_warps
            )
        return self._sources[dtype]

    def sharded_kernel_sources(self, dtype: str = "bf16") -> tuple:
        """(sources, layout, zy_first) of the vocabulary-parallel launch sequence for ``dtype``:
        one kernel per reduction pass, then the loss and gradient kernel."""
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
        key = ("tiles", dtype)
        if key not in self._scaled:
            form = scaled_exp_form(lower_loss(self.rule, dtype))
            self._scaled[key] = form is not None and form.factor != 1
        return scaled_tiles(dtype, tma, self._scaled[key])

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

    def _residue(self, call: _Call) -> Residue | None:
        """What a call's runs need to add the target column's residue, or ``None``. A 16-bit
        ``grad_weight`` takes its rows in the weight-gradient kernel where tensor descriptors
        pay (``descriptors_pay``) or ``tiles`` asks for them (``tma``), else through fp32
        blocks of cuBLAS's products (``residue.SliceTerms``)."""
        sources = self.residue_sources(call.dtype)
        if not sources:
            return None
        weight_grad = None
        if self.tiles is None and call.device.type == "cuda" and descriptors_pay(call.device):
            weight_grad = self.weight_grad_sources(call.dtype)
        elif self.tiles is not None and self.tiles.tma:
            weight_grad = self.weight_grad_sources(call.dtype, self.tiles)
        return Residue(sources, call.device, call.ignore_index, weight_grad)

    def _gradient_tiles(self, dtype: str, tma: bool = False) -> Tiles:
        if (dtype, tma) not in self._grad_tiles:
            self._grad_tiles[dtype, tma] = gradient_tiles(lower_loss(self.rule, dtype), tma)
        return self._grad_tiles[dtype, tma]

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
        """The generated Triton source for bf16 inputs, as text."""
        return self.kernel_source("bf16").text

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
        reduction: str = "mean",
        accumulate_into: str | None = None,
        process_group=None,
        memory: str = "auto",
        **hyper_overrides,
    ) -> torch.Tensor:
        dtype = _check_call(hidden, weight, target, bias, reduction, accumulate_into)
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
        out = self._run_call(
            call, x, weight, bias, y, memory, reduction, main_grad, want_grad, process_group, target.shape
        )
        if reduction == "none":
            out = out.reshape(hidden.shape[:-1])
        return out

    def _run_call(
        self, call: _Call, x, weight, bias, y, memory, reduction, main_grad, want_grad, group, shape
    ):
        """Rows whose target is ``ignore_index`` are left out of every kernel, matmul and
        collective (finding them reads their count on the host, once per call; every rank
        of ``group`` holds the same targets, so all leave out the same rows): their loss and
        their ``grad_hidden`` are 0. The count of the others is the mean's denominator. Then
        the schedule runs."""
        n = y.shape[0]
        slices = None if group is None else self._vocab_slices(call, group)
        vocab = call.vocab if group is None else sum(slices)  # (targets are global indices)
        idx, count = live_rows(y, call.ignore_index, vocab, shape, slices)  # (the one host read)
        if idx is not None:
            x, y = x.index_select(0, idx), y.index_select(0, idx)
            call = replace(call, n_tokens=count)
        x, weight = x.contiguous(), weight.contiguous()  # (the kernels take rows H elements apart)
        bias = bias.contiguous() if bias is not None else None
        main_grad = main_grad and weight.requires_grad
        plan = self._schedule_of(call, memory, want_grad, main_grad, weight, group, bias, reduction)
        if plan == "fused":
            run = self._fused_run(call, x, weight, bias, group)
        elif plan == "scaled" and want_grad:
            run = self._scaled_run(call, x, weight)
        elif group is not None:
            run = self._vocab_parallel_run(call, group)
        else:
            run = self._one_device_run(call, plan, want_grad)
        buffered = main_grad and self._buffers_main_grad(memory)
        out = LinearLoss.apply(x, weight, bias, y, run, reduction, main_grad, want_grad, buffered, count)
        if call.n_tokens < n and reduction == "none":
            out = torch.zeros(n, dtype=out.dtype, device=out.device).index_copy(0, idx, out)
        return out

    def _schedule_of(
        self, call: _Call, memory: str, want_grad: bool, main_grad: bool, weight, group, bias, reduction: str
    ) -> str:
        """The schedule a call runs: ``self.schedule`` (``scaled`` only where
        ``_scaled_refusal`` has nothing against it), or the one ``memory`` names, or (auto)
        chunks of tokens with ``group`` or without gradients, else the one
        ``choose_schedule`` picks by memory, with ``scaled`` in place of ``chunks`` where it
        pays (``_scaled_pays``: bf16 inputs on sm_90 or later, H up to ``SCALED_MAX_HIDDEN``) and
        can run the call, and ``fused`` in place of ``vocab`` (into ``main_grad``, H up to
        ``LEAN_MAIN_GRAD_MAX_HIDDEN``), or of ``chunks`` for fp16 inputs (H up to
        ``LEAN_FP16_MAX_HIDDEN``), on GPUs where it was measured (``_measured_faster``). With ``main_grad``
        buffered (``_buffers_main_grad``), the schedules that take gradients in forward run
        as they do without it."""
        in_backward = main_grad and not self._buffers_main_grad(memory)
        if self.schedule == "scaled":
            why = self._scaled_refusal(call, in_backward, group, bias, reduction)
            if why:
                raise ValueError(f"schedule='scaled' cannot run this call: {why}")
        if self.schedule != "auto":
            return self.schedule
        if memory == "lean":
            return "fused"
        if group is not None or not want_grad:
            return "chunks"
        chosen = self._auto_schedule(call, main_grad, memory, weight)
        if chosen == "vocab" and _measured_faster(call, LEAN_MAIN_GRAD_MAX_HIDDEN):
            return "fused"
        if (
            chosen == "chunks"
            and self._scaled_pays(call)
            and not self._scaled_refusal(call, in_backward, group, bias, reduction)
        ):
            return "scaled"
        if chosen == "chunks" and call.dtype == "fp16" and _measured_faster(call, LEAN_FP16_MAX_HIDDEN):
            # (fp16 takes its gradients in backward, where chunks computes the logits twice
            # as the lean schedule does, and also writes them: H200, gist, 54.0-57.3 against
            # 51.2-51.4 ms)
            return "fused"
        return chosen

    def _buffers_main_grad(self, memory: str) -> bool:
        """Whether a call into ``main_grad`` may take its gradients in forward (``chunks``,
        ``scaled``): the weight's into an fp32 ``[V, H]`` buffer, which backward adds into
        ``main_grad`` times ``grad_output``. With ``memory="fast"`` (one logits matmul per
        chunk, at the buffer's memory), or ``schedule="scaled"``, which takes them there;
        otherwise ``main_grad`` gets them in backward, with no buffer."""
        return memory == "fast" or self.schedule == "scaled"

    @staticmethod
    def _scaled_pays(call: _Call) -> bool:
        """Whether the scaled schedule outruns chunks of logits for a call's sizes (measured
        on sm_90, where its kernel takes tensor descriptors)."""
        return _measured_faster(call, SCALED_MAX_HIDDEN)

    def _scaled_refusal(self, call: _Call, main_grad: bool, group, bias, reduction: str) -> str | None:
        """Why the scaled schedule cannot run a call, or ``None``."""
        if self.scaled_kernel_source(call.dtype) is None:
            name = self.rule.name
            return (
                f"the gradient of loss rule {name!r} is not A * softmax + B * [target] + C per token, "
                "nor a'(z) * (A * softmax + B * [target]) for the logsumexp's argument a(z)"
            )
        if call.dtype not in SCALED_DTYPES:  # (fp16)
            return (
                "fp16 holds its E = exp(a(z) - a(z[y])) only below 65504 (a logit 11 above the target's) "
                "and rounds a gradient taken in forward, before any loss scale, below 6e-8 to 0: "
                "bf16 or fp32 inputs take it"
            )
        if reduction == "none":
            return (
                "reduction='none' scales each token's gradient in backward; it takes the gradient in forward"
            )
        if main_grad:
            return "accumulate_into='main_grad' takes the gradient in backward (memory='fast' buffers it)"
        if group is not None:
            return "it runs on one device (no process_group)"
        if bias is not None:
            return "it takes no bias"
        return None

    def _auto_schedule(self, call: _Call, main_grad: bool, memory: str, weight) -> str:
        return choose_schedule(
            call.n_tokens,
            call.hid,
            call.vocab,
            call.es,
            chunk=self._chunk(call),
            main_grad=main_grad and memory == "auto",
            weight_fp32=weight.dtype == torch.float32,
        )

    def _chunk(self, call: _Call) -> int:
        return self.chunk_size or chunk_rows(call.n_tokens, call.hid, call.vocab, call.es)

    def _one_device_run(self, call: _Call, plan: str, want_grad: bool):
        """The run of a one-device call with logits in memory: row kernels over chunks of
        tokens, or a staged schedule."""
        chunk = self._chunk(call)
        if not want_grad or plan == "chunks":
            run = Chunked(self.kernel_source(call.dtype), call.device, call.hyper, call.ignore_index, chunk)
        else:
            sources, layout, zy_first = self.sharded_kernel_sources(call.dtype)
            if plan == "vocab":
                chunk = min(chunk, forward_rows(call.vocab, call.es))
            run = Staged(sources, layout, zy_first, call.device, call.hyper, call.ignore_index, chunk)
            run.schedule, run.cols = plan, vocab_cols(call.n_tokens, call.hid, call.es, self.block)
        run.residue = self._residue(call) if want_grad else None
        return run

    def _scaled_run(self, call: _Call, x, weight) -> ScaledExp:
        """The scaled schedule's run, with the row kernel's as its fallback (built if a call
        needs it)."""
        aligned = x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
        descriptors = aligned and call.hid * call.es % 16 == 0
        if self.tiles is None and call.device.type == "cuda":
            tiles = self._scaled_tiles(call.dtype, descriptors and descriptors_pay(call.device))
            tiles = _specialized(tiles, call, SCALED_WARP_SPECIALIZED_MAX_HIDDEN)
        else:
            tiles = self.tiles or INTERPRETER_TILES
            if tiles.tma and not descriptors:
                tiles = replace(tiles, tma=False)
        tiles = tiles.for_hidden(call.hid, aligned)
        sources = self.sharded_kernel_sources(call.dtype)[0]
        chunk = self._chunk(call)

        def fallback() -> Chunked:
            run = Chunked(self.kernel_source(call.dtype), call.device, call.hyper, call.ignore_index, chunk)
            run.residue = self._residue(call)
            return run

        kernels = (self.scaled_kernel_source(call.dtype, tiles), *self.scaled_token_sources(call.dtype))
        return ScaledExp(
            kernels, sources[-1], self._values(call.dtype), tiles, call.device, call.hyper,
            call.ignore_index, chunk, fallback,
        )  # fmt: skip

    def _values(self, dtype: str) -> TokenValues:
        """The scaled form's ``TokenValues`` for ``dtype`` (a rule that has the form)."""
        if dtype not in self._token_values:
            plan = lower_loss(self.rule, dtype)
            self._token_values[dtype] = TokenValues(plan, scaled_exp_form(plan), shard_layout(plan))
        return self._token_values[dtype]

    def _tile_sums(self, call: _Call, rows_16: bool, aligned: bool) -> TileSums | None:
        """The lean forward's ``TileSums`` for a one-device call without a bias, where the rule's
        gradient has the scaled form with no function but ``exp`` and ``approx_tanh`` in its
        pass (``tile_sums_pay``), in Triton's interpreter and on a GPU whose descriptors are TMA
        for 16-bit inputs they can address (``rows_16``; ``fuser.runtime.loss.fused`` has the
        times). Else ``None``: the sweeps run."""
        key = ("tile_sums_pay", call.dtype)
        if key not in self._scaled:
            self._scaled[key] = tile_sums_pay(lower_loss(self.rule, call.dtype))
        if not self._scaled[key]:
            return None
        if self.tiles is None and call.device.type == "cuda":
            if not (call.es == 2 and rows_16 and descriptors_pay(call.device)):
                return None
            tiles = _specialized(scaled_tiles(call.dtype, True), call, SCALED_WARP_SPECIALIZED_MAX_HIDDEN)
        else:
            tiles = self.tiles or INTERPRETER_TILES
            if tiles.tma and not rows_16:
                tiles = replace(tiles, tma=False)
        tiles = tiles.for_hidden(call.hid, aligned)
        sources = self.tile_sums_sources(call.dtype, tiles)
        return TileSums(sources, self._values(call.dtype), tiles, call.device)

    def _fused_run(self, call: _Call, x, weight, bias, group=None) -> Fused:
        """The lean schedule's run: matmul kernels for this device, hidden size and bias;
        with ``group``, over this rank's slice of the vocabulary."""
        aligned = x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
        rows_16 = aligned and call.hid * call.es % 16 == 0  # (what tensor descriptors need)
        if self.tiles is None and call.device.type == "cuda":
            # (the sweeps keep pointer loads: through descriptors they ran no faster, H100)
            tiles = Tiles().for_dtype(call.dtype)
            grad_tiles = self._gradient_tiles(call.dtype, rows_16 and descriptors_pay(call.device))
            grad_tiles = _specialized(grad_tiles, call, GRAD_WARP_SPECIALIZED_MAX_HIDDEN)
        else:
            tiles = grad_tiles = self.tiles or INTERPRETER_TILES
            if tiles.tma and not rows_16:
                tiles = grad_tiles = replace(tiles, tma=False)
        tiles, grad_tiles = (t.for_hidden(call.hid, aligned) for t in (tiles, grad_tiles))
        sweeps, grad = self.matmul_kernel_sources(
            call.dtype, tiles, grad_tiles=grad_tiles, has_bias=bias is not None
        )
        sources, layout, _ = self.sharded_kernel_sources(call.dtype)
        cols = slice_cols(call.n_tokens, call.hid, call.es, max(tiles.bn, grad_tiles.bn), MAIN_GRAD_BUDGET)
        kernels = (sweeps, grad, sources[-1])
        tile_sums = self._tile_sums(call, rows_16, aligned) if group is None and bias is None else None
        run = Fused(
            kernels, layout, (tiles, grad_tiles), call.device, call.hyper, call.ignore_index, cols, tile_sums
        )
        run.residue = self._residue(call)
        if group is not None:
            run.shard(group, *self._shards(call, group))
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

    def _vocab_slices(self, call: _Call, group) -> tuple[int, ...]:
        """Every rank's vocabulary slice length (their sum bounds the targets), for a
        schedule that runs with ``group``."""
        if self.schedule in ("whole", "vocab", "scaled"):
            raise ValueError(
                f"schedule={self.schedule!r} is for one device; a vocabulary-parallel loss "
                "(process_group=) runs in chunks of tokens, or with memory='lean' in the matmul kernels"
            )
        return self._shards(call, group)[0]

    def _vocab_parallel_run(self, call: _Call, process_group) -> ShardedChunked:
        """The run of a call with ``process_group=``: this rank's vocabulary slice, in chunks
        of tokens that every rank runs alike."""
        sizes, rank = self._shards(call, process_group)
        total = sum(sizes)
        # Every rank must run as many chunks (each has its collectives): size them by
        # the largest slice, the same on every rank.
        chunk = self.chunk_size or chunk_rows(call.n_tokens, call.hid, max(sizes), call.es)
        sources, layout, zy_first = self.sharded_kernel_sources(call.dtype)
        run = ShardedChunked(
            sources,
            layout,
            zy_first,
            call.device,
            call.hyper,
            call.ignore_index,
            chunk,
            process_group,
            sum(sizes[:rank]),
            total,
        )
        run.residue = self._residue(call)
        return run

    def __repr__(self) -> str:
        return f"<fuser compiled loss {self.rule.name!r}>"

    def _repr_html_(self) -> str:
        """Jupyter shows a compiled loss as its generated Triton source."""
        from fuser.display import loss_html

        return loss_html(self)


def _measured_faster(call: _Call, max_hidden: int) -> bool:
    """16-bit inputs on a GPU whose kernels take tensor descriptors (``descriptors_pay``),
    with H up to ``max_hidden``: where ``auto``'s matmul-kernel schedules were measured
    faster than the cuBLAS ones."""
    return (
        call.device.type == "cuda"
        and call.es == 2
        and call.hid <= max_hidden
        and descriptors_pay(call.device)
    )


def scaled_tiles(dtype: str, tma: bool, narrow: bool = False) -> Tiles:
    """The scaled kernel's tiles on a GPU; ``tma``: where tensor descriptors are TMA, taken
    for 16-bit inputs (fp32 tiles through descriptors overflow sm_90's shared memory);
    ``narrow``: for a form whose ``E`` carries ``a'(z)`` (``SCALED_TILES_NARROW``)."""
    if tma and dtype != "fp32":
        return SCALED_TILES_NARROW_TMA if narrow else SCALED_TILES_TMA
    return (SCALED_TILES_NARROW if narrow else SCALED_TILES).for_dtype(dtype)


def _specialized(tiles: Tiles, call: _Call, max_hidden: int) -> Tiles:
    """A GPU call's ``tiles``, warp-specialised (``warp_specialized``, where they allow it)
    on sm_90 with H up to ``max_hidden``."""
    if call.hid <= max_hidden and warp_specialization_pays(call.device):
        return warp_specialized(tiles)
    return tiles


def warp_specialization_pays(device: torch.device) -> bool:
    """Whether the matmul kernels' warp-specialised programs (``warp_specialized``) are taken
    on ``device``: sm_90, where Triton 3.6 makes them (a producer warp group issuing the TMA
    loads, two consumers) and where they were measured. Blackwell's warp specialisation is
    another pass, not measured here."""
    return torch.cuda.get_device_capability(device)[0] == 9


def descriptors_pay(device: torch.device) -> bool:
    """Whether tensor descriptors pay on ``device``: from sm_90 they are TMA, and the lean
    schedule's gradient kernel takes them where ``gradient_tiles`` allows (16-bit inputs,
    rules whose gradient calls only exp and approx_tanh), its programs persistent (H100, the kernel alone:
    gist 17.7 -> 14.7 ms, llama8b 16.0 -> 13.4 ms; benchmarks/NOTES.md). Before sm_90
    Triton lowers descriptors to pointer loads, and the kernel keeps its own."""
    return torch.cuda.get_device_capability(device)[0] >= 9


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
    where ``_scaled_pays``), ``tiles`` (``fuser.codegen.loss_matmul.Tiles``: block shape of the
    matmul kernels)."""
    return CompiledLoss(rule, **options)


def grad_scale_sources(dtype: str) -> list[KernelSource]:
    """The kernels that multiply the gradients a forward took (``chunks`` and ``scaled``, not
    for fp16 inputs) by ``grad_output`` in backward, for ``dtype`` inputs: ``grad_weight``
    and ``grad_bias`` from fp32 into ``dtype``, ``grad_hidden`` in place (none for fp32,
    which torch scales in place, nor fp16)."""
    return [render_grad_scale("fp32", dtype), render_grad_scale(dtype, dtype)] if dtype == "bf16" else []


def kernel_sources(
    rule: Rule, dtype: str = "bf16", *, vocab_parallel: bool = False, **options
) -> list[KernelSource]:
    """Every kernel a compiled ``rule`` launches for inputs of ``dtype``: the row kernel, the
    staged sequence (which calls with ``process_group=`` and the ``whole``, ``vocab``,
    ``fused`` and ``scaled`` schedules launch), the lean schedule's matmul kernels (with, for
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
    the residue's and the gradients' scaling."""
    f = CompiledLoss(rule, **options)
    staged = list(f.sharded_kernel_sources(dtype)[0])
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
    if tile_sums_pay(lower_loss(rule, dtype)) and (f.tiles is not None or dtype != "fp32"):  # (_tile_sums)
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
    return [f.kernel_source(dtype), *staged, *lean, *scaled, *residue]
