"""``LossPlan`` -> ``KernelSource``: the row kernel of a loss epilogue.

The template (``templates/loss_rows.py.jinja``) carries the structure: one program per row,
a ``while`` sweep per reduction pass, the per-token loss, the gradient sweep. Every
expression comes from ``TritonPrinter``; this module only names variables and writes the
accumulator updates of each reduction kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fuser.codegen.printer import TritonPrinter
from fuser.codegen.render import MAX_COMBINE, SUM, SUM_COMBINE, environment, helpers_source, store_cast
from fuser.codegen.source import KernelSource
from fuser.ir.loss import IS_Y, VOCAB, Z_Y, Accumulator, LossPlan, Pass, Z
from fuser.rules.loss import T_Y, T
from fuser.rules.parse import symbol

TRITON_DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}

# Columns of one row per loop step, and warps per program: 1024-8192 over 4-16 warps ran within
# 5%, and 2048 keeps `vocab`'s slices whole blocks (benchmarks/NOTES.md, "The chunks schedule").
DEFAULT_BLOCK = 2048
DEFAULT_WARPS = 8

SIGNATURE_TAIL = (
    ("target", "*i64"),
    ("loss", "*fp32"),
    ("resid", "*fp32"),
    ("scale", "*fp32"),
    ("scale_stride", "i32"),
    ("hyper", "*fp32"),
    ("n_cols", "i32"),
    ("ignore_index", "i64"),
    ("compute_grad", "i32"),
)


def _kernel_name(sym: sympy.Symbol) -> str:
    return sym.name.replace("$", "")


class LossNames(dict):
    """Symbol -> kernel variable: rule inputs by fixed names, hyperparameters as ``h_<name>``,
    a token rule's per-token inputs as ``in_<name>``, fuser's own symbols (which carry a
    ``$``) by their name without it."""

    def __init__(self, hyper: tuple[str, ...], inputs: tuple[str, ...] = ()):
        super().__init__({Z: "z", Z_Y: "z_y", T: "t", T_Y: "t_y", VOCAB: "vocab", IS_Y: "is_y"})
        self.update({symbol(h): f"h_{h}" for h in hyper})
        self.update({symbol(n): f"in_{n}" for n in inputs})

    def __missing__(self, sym):
        if isinstance(sym, sympy.Symbol) and "$" in sym.name:
            return _kernel_name(sym)
        raise KeyError(sym)


class LossPrinter(TritonPrinter):
    def __init__(self, names: LossNames):
        super().__init__()
        self.names = names  # keeps LossNames.__missing__ (the base class copies into a dict)

    def _print_Symbol(self, expr):
        return self.names[expr]


def indicator_lines(exprs, printer) -> list[str]:
    """`is_max<i>` lines for the argmax indicators read by ``exprs``."""
    used = set()
    for e in exprs:
        used |= {s for s in e.free_symbols if s.name.startswith("is_max$")}
    lines = []
    for s in sorted(used, key=lambda s: s.name):
        i = s.name.split("$")[1]
        lines.append(f"{printer.names[s]} = (cols == am{i}).to(tl.float32)")
    return lines


ARGMAX_COMBINE = "tl.standard._argmax_combine_tie_break_left"


def _sum(x: str) -> str:
    return f"{SUM}({x}, 0, {SUM_COMBINE})"


def _max(x: str) -> str:
    return f"{SUM}({x}, 0, {MAX_COMBINE})"


def _accumulator_lines(acc: Accumulator, arg: str) -> tuple[list[str], list[str], list[str]]:
    """(init, update, finish) lines of one reduction. Rows that are not ``live`` (ignored)
    sweep nothing and finish at 0, so what follows stays finite.

    Reductions call ``tl.reduce`` with Triton's own combiners, as the optimizer kernels do
    (see ``fuser.codegen.render``): ``tl.sum``/``tl.max``/``tl.argmax`` are jitted library
    functions that the interpreter only runs when it was on at import.
    """
    if acc.op == "logsumexp":
        return _logsumexp_lines(acc.index, arg)
    if acc.op == "sum":
        return _sum_lines(acc.index, arg)
    if acc.op == "max":
        return _max_lines(acc.index, arg)
    raise ValueError(f"unknown reduction {acc.op!r}")


def _logsumexp_lines(i: int, arg: str) -> tuple[list[str], list[str], list[str]]:
    # Online logsumexp per lane: each lane keeps a running max and the sum of
    # exp(a - max), rescaled when its max grows, so one sweep suffices, nothing
    # overflows, and the loop carries no cross-lane reduction (the lanes are combined
    # once at the end). One exponential per element: of exp(lm - max) and exp(a - max)
    # one is 1, so only the other is taken (ex), and the sum becomes ls * ex + 1 when a
    # is the new max, ls + ex otherwise (a NaN logit takes the second branch: exp(NaN)
    # makes the sum NaN). A lane that has seen only masked columns holds max -inf and
    # sum 0; ``s`` stands in 0 for its max so that no -inf - -inf appears.
    return (
        [
            f'lm{i} = tl.full((BLOCK,), float("-inf"), tl.float32)',
            f"ls{i} = tl.full((BLOCK,), 0.0, tl.float32)",
        ],
        [
            f'a{i} = tl.where(mask, {arg}, float("-inf"))',
            f"nm{i} = tl.maximum(lm{i}, a{i})",
            f'sm{i} = tl.where(nm{i} == float("-inf"), 0.0, nm{i})',
            f"up{i} = a{i} > lm{i}",
            f"ex{i} = tl.exp(tl.where(up{i}, lm{i}, a{i}) - sm{i})",
            f"ls{i} = tl.where(up{i}, ls{i} * ex{i} + 1.0, ls{i} + ex{i})",
            f"lm{i} = nm{i}",
        ],
        [
            f"mm{i} = {_max(f'lm{i}')}",
            f'mm{i} = tl.where(mm{i} == float("-inf"), 0.0, mm{i})',
            f"ss{i} = {_sum(f'ls{i} * tl.exp(lm{i} - mm{i})')}",
            f"r{i} = tl.where(live, mm{i}, 0.0) + tl.log(tl.where(live, ss{i}, 1.0))",
        ],
    )


def _sum_lines(i: int, arg: str) -> tuple[list[str], list[str], list[str]]:
    # Per-lane partial sums, added across lanes once at the end: fewer cross-lane
    # reductions, and rounding grows with V / BLOCK rather than V.
    return (
        [f"acc{i} = tl.full((BLOCK,), 0.0, tl.float32)"],
        [f"acc{i} += tl.where(mask, {arg}, 0.0)"],
        [f"r{i} = {_sum(f'acc{i}')}"],
    )


def _max_lines(i: int, arg: str) -> tuple[list[str], list[str], list[str]]:
    # The first column holding the maximum: its indicator carries the gradient. The
    # indices reduced are positions in the block (the interpreter returns those
    # whatever index values it is given).
    return (
        [f'mx{i} = tl.full((), float("-inf"), tl.float32)', f"am{i} = tl.full((), 0, tl.int32)"],
        [
            f'a{i} = tl.where(mask, {arg}, float("-inf"))',
            f"tm{i}, ta{i} = {SUM}((a{i}, tl.arange(0, BLOCK)), 0, {ARGMAX_COMBINE})",
            f"am{i} = tl.where(tm{i} > mx{i}, ta{i} + start, am{i})",
            f"mx{i} = tl.maximum(mx{i}, tm{i})",
        ],
        [f"r{i} = tl.where(live, mx{i}, 0.0)"],
    )


def _pass_context(p: Pass, printer) -> dict:
    return pass_context(p, printer, _accumulator_lines)


def pass_context(p: Pass, printer, accumulator_lines) -> dict:
    """The template context of one reduction pass; ``accumulator_lines(acc, arg)`` gives the
    (init, update, finish) lines of one accumulator in the template's own terms."""
    init, update, finish = [], [], []
    for acc in p.accumulators:
        a, b, c = accumulator_lines(acc, printer.doprint_expr(acc.arg))
        init += a
        update += b
        finish += c
    exprs = [e for _, e in p.body] + [a.arg for a in p.accumulators]
    body = indicator_lines(exprs, printer)
    body += [f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in p.body]
    return dict(
        reads_t=any(T in e.free_symbols for e in exprs),
        summary=", ".join(f"r{a.index} = {a.op}(...)" for a in p.accumulators),
        prologue=[f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in p.prologue],
        init=init,
        body=body,
        accumulate=update,
        finish=finish,
    )


def comment_text(expr: sympy.Expr) -> str:
    return str(expr).replace("$", "")


def loss_entry(plan: LossPlan) -> str:
    return f"{plan.name}_loss_rows"


# A token rule's kernels read its per-token inputs, then (when computing the gradient) the
# upstream gradient of each output, as rows of one fp32 tensor, and write each output as a
# row of ``loss``; both have rows ``token_stride`` elements apart.
TOKEN_SIGNATURE_TAIL = (("inputs", "*fp32"), ("token_stride", "i64"))

# A rule that reads the teacher's logits takes them as a second fp32 buffer of the
# student's row stride, after the token arguments.
TEACHER_SIGNATURE_TAIL = (("teacher", "*fp32"),)

SHARDED_SIGNATURE_TAIL = (("red", "*fp32"), ("part", "*fp32"), ("col_offset", "i64"), ("vocab_total", "i64"))


@dataclass(frozen=True)
class ShardLayout:
    """Where a vocabulary-parallel launch sequence keeps its per-token values.

    Stage ``s < len(plan.passes)`` runs sweep ``s`` over this rank's columns and writes its
    partials to ``part`` (``part_cols[s]``: ``(reduction index, op, column)``; a ``max`` also
    writes its argmax column, local, at ``column + 1``; stage 0's last column is the
    driver's). The driver combines them across the group into ``red``: column 0 holds
    ``z_y``, ``red_cols[i]`` reduction ``i`` and, for a ``max``, ``red_cols[i] + 1`` the argmax
    column in this shard (-1 where another rank holds it). The last stage reads ``red`` and
    writes the loss and the gradient.
    """

    part_cols: tuple[tuple[tuple[int, str, int], ...], ...]
    part_widths: tuple[int, ...]
    red_cols: dict
    red_width: int

    @property
    def stages(self) -> int:
        return len(self.part_cols) + 1


def shard_layout(plan: LossPlan) -> ShardLayout:
    red_cols, width = {}, 1
    for acc in plan.reductions:
        red_cols[acc.index] = width
        width += 2 if acc.op == "max" else 1
    part_cols, part_widths = [], []
    for p in plan.passes:
        cols, w = [], 0
        for acc in p.accumulators:
            cols.append((acc.index, acc.op, w))
            w += 2 if acc.op == "max" else 1
        part_cols.append(tuple(cols))
        # Stage 0 keeps a last column for the driver's z[y] partial, combined in the same
        # collective when no sweep reads z[y] before it.
        part_widths.append(w + 1 if not part_widths else max(w, 1))
    return ShardLayout(tuple(part_cols), tuple(part_widths), red_cols, width)


def red_loads(plan: LossPlan, layout: ShardLayout, passes: int, at: str, index_type: str) -> list[str]:
    """Loads of ``z_y`` and of the reductions of the first ``passes`` passes from the
    row of ``red`` at ``at`` (a max's argmax column as ``index_type``)."""
    lines = [f"z_y = tl.load({at})"]
    for p in plan.passes[:passes]:
        for acc in p.accumulators:
            c = layout.red_cols[acc.index]
            lines.append(f"r{acc.index} = tl.load({at} + {c})")
            if acc.op == "max":
                lines.append(f"am{acc.index} = tl.load({at} + {c + 1}).to({index_type})")
    return lines


def _shard_lines(plan: LossPlan, layout: ShardLayout, stage: int) -> tuple[list[str], list[str]]:
    """(loads, stores) of one stage: combined values read from ``red``, partials written."""
    loads = red_loads(plan, layout, stage, f"red + row * {layout.red_width}", "tl.int32")
    stores = []
    if stage < len(plan.passes):
        w = layout.part_widths[stage]
        for i, op, c in layout.part_cols[stage]:
            stores.append(f"tl.store(part + row * {w} + {c}, r{i})")
            if op == "max":
                stores.append(f"tl.store(part + row * {w} + {c + 1}, am{i}.to(tl.float32))")
    return loads, stores


def render_loss(
    plan: LossPlan, *, block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_WARPS, stage: int | None = None
) -> KernelSource:
    """Render the row kernel of a loss plan.

    With ``stage`` (``0 .. len(plan.passes)``), render one kernel of the vocabulary-parallel
    sequence instead (see ``ShardLayout``): the sweep of that pass, or the loss and gradient.
    """
    if block & (block - 1) or block < 16:
        raise ValueError(f"block must be a power of two >= 16, not {block}")
    sharded = stage is not None
    if sharded and plan.teacher and T_Y in _plan_symbols(plan):
        raise ValueError(
            f"{plan.name} reads the teacher's logit at the target, t[y]: no vocabulary-parallel "
            "kernels take it yet (t alone, in reductions and elementwise, they take)"
        )
    if sharded and not 0 <= stage <= len(plan.passes):
        raise ValueError(f"stage must be in [0, {len(plan.passes)}], not {stage}")
    entry = loss_entry(plan) + (f"_vp{stage}" if sharded else "")
    context = _template_context(plan, stage)
    text = environment().get_template("loss_rows.py.jinja").render(entry=entry, **context)
    signature = (("logits", TRITON_DTYPES[plan.dtype]), ("stride", "i32")) + SIGNATURE_TAIL
    if plan.token:
        signature += TOKEN_SIGNATURE_TAIL
    if plan.teacher:
        signature += TEACHER_SIGNATURE_TAIL
    if sharded:
        signature += SHARDED_SIGNATURE_TAIL
    return KernelSource(
        text=text,
        entry=entry,
        signature=signature,
        constexprs=(("BLOCK", block), ("INTERPRETED", False)),
        num_warps=num_warps,
        num_stages=1,
        meta=(("rule", plan.name), ("kind", "loss"), ("dtypes", f"logits:{plan.dtype}")),
    )


def rule_context(plan: LossPlan) -> dict:
    """What every loss template reads of the plan: the rule and its derivation (for the
    header), the helpers, and the hyperparameters' loads."""
    return dict(
        name=plan.name,
        dtype=plan.dtype,
        rule_lines=plan.rule_text.splitlines(),
        derivation=[f"{k}: {comment_text(v)}" for k, v in plan.derivation],
        helpers=helpers_source(),
        hyper=plan.hyper,
        hyper_names=", ".join(plan.hyper) or "(none)",
        hyper_loads=[f"h_{h} = tl.load(hyper + {j})" for j, h in enumerate(plan.hyper)],
        sum_of=lambda v, axis: f"{SUM}({v}, {axis}, {SUM_COMBINE})",
    )


def _template_context(plan: LossPlan, stage: int | None) -> dict:
    """What the row-kernel template reads besides the entry's name: the plan, the sweeps of
    ``stage`` (every pass when ``None``), and the lines of the loss and the gradient."""
    sharded = stage is not None
    layout = shard_layout(plan) if sharded else None
    loads, stores = _shard_lines(plan, layout, stage) if sharded else ([], [])
    printer = LossPrinter(LossNames(plan.hyper, plan.inputs))
    grad_body = _grad_body(plan, printer)
    passes = plan.passes[stage : stage + 1] if sharded else plan.passes
    return dict(
        **rule_context(plan),
        passes=[_pass_context(p, printer) for p in passes],
        sharded=sharded,
        final=not sharded or stage == len(plan.passes),
        loads=loads,
        stores=stores,
        red_width=layout.red_width if sharded else 0,
        part_width=layout.part_widths[stage] if sharded and stage < len(plan.passes) else 0,
        epilogue=[f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in plan.epilogue],
        outputs=_output_lines(plan, printer),
        output_names=", ".join(plan.outputs),
        token=plan.token,
        teacher=plan.teacher,
        reads_t_y=plan.teacher and T_Y in _plan_symbols(plan),
        grad_reads_t=any(T in e.free_symbols for e in [e for _, e in plan.grad.body] + [plan.grad_value]),
        token_inputs=[*plan.inputs, *(f"d {n}" for n in plan.outputs)] if plan.token else [],
        input_loads=_input_loads(plan) if plan.token else [],
        grad=dict(body=grad_body),
        grad_value=printer.doprint_expr(plan.grad_value),
        store=store_cast("dz", plan.dtype),
        residue=has_residue(plan),
        rounded=f"{store_cast('d_y', plan.dtype)}.to(tl.float32)",
    )


def _plan_symbols(plan: LossPlan) -> set:
    """Every symbol the kernel's expressions read."""
    exprs = [e for p in plan.passes for _, e in p.prologue + p.body] + [a.arg for a in plan.reductions]
    exprs += [e for _, e in plan.epilogue + plan.grad.body] + [plan.loss, plan.grad_value, *plan.values]
    return set().union(*(e.free_symbols for e in exprs))


def _output_lines(plan: LossPlan, printer) -> list[dict]:
    """Each output's value and where its row of ``loss`` starts (one output: the loss)."""
    if not plan.token:
        return [dict(value=printer.doprint_expr(plan.loss), offset="")]
    return [
        dict(value=printer.doprint_expr(v), offset=f"{j} * token_stride + " if j else "")
        for j, v in enumerate(plan.values)
    ]


def _input_loads(plan: LossPlan) -> list[str]:
    """Loads of a token rule's per-token inputs, then of each output's upstream gradient
    (rows after the inputs, present only when the launch computes the gradient)."""
    lines = [f"in_{n} = tl.load(inputs + {j} * token_stride + row)" for j, n in enumerate(plan.inputs)]
    m = len(plan.inputs)
    lines += [
        f"dout{i} = tl.load(inputs + {m + i} * token_stride + row, mask=compute_grad != 0, other=0.0)"
        for i in range(len(plan.outputs))
    ]
    return lines


def has_residue(plan: LossPlan) -> bool:
    """Whether the gradient kernels of ``plan`` write the target column's residue: the
    logit gradient at the target less its rounding to 16 bits (``fuser.runtime.loss.residue``
    adds it back in fp32). Not for fp32 storage, nor for a gradient without a target term."""
    exprs = [e for _, e in plan.grad.body] + [plan.grad_value]
    return plan.dtype != "fp32" and any(IS_Y in e.free_symbols for e in exprs)


def _grad_body(plan: LossPlan, printer) -> list[str]:
    """The gradient sweep's lines before ``dloss/dz``: the target and argmax indicators it
    reads, then the plan's gradient body."""
    grad_exprs = [e for _, e in plan.grad.body] + [plan.grad_value]
    grad_body = (
        ["is_y = (cols == y_safe).to(tl.float32)"] if any(IS_Y in e.free_symbols for e in grad_exprs) else []
    )
    grad_body += indicator_lines(grad_exprs, printer)
    grad_body += [f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in plan.grad.body]
    return grad_body
