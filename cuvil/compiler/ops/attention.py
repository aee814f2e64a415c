"""cuvil's Attention: softmax(Q @ K^T (* or / scale) (+ mask)) @ V in one parallel loop
(passes/fuse_attention.py recognizes it in a graph; exporters write it as MatMul, Mul or Div,
Add, Softmax, MatMul).

Inputs: q [..., s, d], k_t [..., d, t] (the keys already transposed, as the graph's first
MatMul reads them), v [..., t, dv] and optionally the mask, added to the scores under numpy
broadcasting; the batch dims of q, k_t and v broadcast too. Attributes: `SCALE`, the constant
the scores are multiplied (`SCALE_OP` "Mul") or divided ("Div") by, when the graph scales them;
`PERMS`, for q, k_t, v and the output, None or the Transpose the node reads the input through
(q = Transpose(input, perm)) or writes the output through (output = Transpose(result, perm)):
the head split and merge around attention ([b, s, h, d] <-> [b, h, s, d]), which then moves no
data. Each keeps the last axis last, so rows stay contiguous for the GEMM kernel.

Unfused, the graph writes the scores [..., s, t] and reads them back three or four times (the
scale, the mask, the softmax, the second product), each step a parallel loop over the whole
tensor. Here a task is a block of up to ROWS query rows of one batch entry: its scores are
computed into the task's scratch slot on the GEMM kernel, scaled, masked and normalized row by
row while they are in the core's cache, and multiplied by V into the output. The steps are
the unfused graph's, on the same kernels (bit for bit the same result where the unfused
products run on the GEMM kernel too; for a few rows they may take the matrix-vector one).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, numel
from cuvil.compiler.kernels.emitter import Emitter, View
from cuvil.compiler.kernels.gemm import emit_gemm
from cuvil.compiler.ops import (
    UNCHECKED,
    InferContext,
    Op,
    attr,
    broadcast_shapes,
    register,
    required_input,
)
from cuvil.compiler.ops._softmax_kernel import emit_softmax_row
from cuvil.compiler.ops._window import ceil_div
from cuvil.compiler.ops.gemm import broadcast_batch, matrix_at, zero_if_empty
from cuvil.compiler.ops.normalization import ROW_COST

#: attributes (module docstring)
SCALE = "cuvil.scale"
SCALE_OP = "cuvil.scale_op"
PERMS = "cuvil.perms"
#: `PERMS` slots
Q, K_T, V, OUT = range(4)
#: query rows per task: the block's scores (ROWS x t floats, 64 KB at t = 128) stay in the
#: core's cache from the first product to the second
ROWS = 128
#: the fewest query rows of a task (a block of the GEMM kernel's tiles)
MIN_ROWS = 16

F32 = ir.FloatType()


def _perm(node: Node, slot: int) -> tuple[int, ...] | None:
    perms = node.attrs.get(PERMS)
    return None if perms is None else perms[slot]


def operand(node: Node, slot: int) -> TensorType:
    """The type of q, k_t or v as the node reads it (`PERMS`)."""
    typ, perm = required_input(node, slot).type, _perm(node, slot)
    return typ if perm is None else TensorType(typ.dtype, tuple(typ.shape[a] for a in perm))


def _view(k: Emitter, node: Node, slot: int) -> View:
    """q, k_t, v (as the node reads them) or the result (before the output's Transpose)."""
    perm = _perm(node, slot)
    if slot == OUT:
        view = k.view(node.outputs[0])
        return view if perm is None else view.permuted(np.argsort(perm).tolist())
    view = k.view(required_input(node, slot))
    return view if perm is None else view.permuted(perm)


def geometry(node: Node, ctx: InferContext) -> tuple[tuple[Dim, ...], Dim, Dim, Dim, Dim]:
    """(batch shape, s, d, t, dv), checked."""
    q, k_t, v = (operand(node, i) for i in (Q, K_T, V))
    for name, typ in (("q", q), ("k_t", k_t), ("v", v)):
        ctx.require(node, typ.rank >= 2 and typ.dtype.name == "float32",
                    f"{name} must be a float32 matrix or batch of matrices, got {typ}")
    s, d = q.shape[-2:]
    d = ctx.dims_equal(node, d, k_t.shape[-2], "the head size of q and k_t")
    t = ctx.dims_equal(node, k_t.shape[-1], v.shape[-2], "the key count of k_t and v")
    batch = broadcast_shapes(node, ctx, q.shape[:-2], k_t.shape[:-2], v.shape[:-2])
    return batch, s, d, t, v.shape[-1]


@register
class Attention(Op):
    op_type = "Attention"
    domain = "cuvil"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        batch, s, _, t, dv = geometry(node, ctx)
        mask = node.input(3)
        if mask is not None:
            scores = (*batch, s, t)
            ctx.require(node, mask.type.dtype.name == "float32"
                        and broadcast_shapes(node, ctx, mask.type.shape, scores) == scores,
                        f"the mask {mask.type} must be float32 and broadcast to the scores "
                        f"{list(scores)}")
        result = (*batch, s, dv)
        perm = _perm(node, OUT)
        return [TensorType(required_input(node, 0).type.dtype,
                           result if perm is None else tuple(result[a] for a in perm))]

    def scratch_bytes(self, node: Node) -> Dim:
        # a slot of at most min(ROWS, s) x t scores per task; the tasks' rows add up to less
        # than s + min(ROWS, s) per batch entry
        batch, s, _, t, _ = geometry(node, UNCHECKED)
        rows = min(ROWS, s) if isinstance(s, int) else sympy.Min(ROWS, s)
        return 4 * numel(batch) * (s + rows) * t

    def lower(self, node: Node, k: Emitter) -> None:
        batch, s, d, t, dv = geometry(node, UNCHECKED)
        zero_if_empty(k, node.outputs[0], t)
        b = k.b
        s_v, count = k.dim(s), k.dim(numel(batch))
        # blocks of ROWS queries, or smaller ones (not under MIN_ROWS) when there are too
        # few batch entries to give every thread two tasks
        per_entry = ceil_div(k, b.mul(k.parallel_threads(), k.i64(2)),
                             k.maximum("int64", count, k.i64(1)))
        rows = k.maximum("int64", ceil_div(k, s_v, per_entry), k.i64(MIN_ROWS))
        rows = k.maximum("int64", k.minimum("int64", rows, k.minimum("int64", s_v, k.i64(ROWS))),
                         k.i64(1))
        blocks = ceil_div(k, s_v, rows)
        assert k.scratch is not None
        cost = b.mul(b.mul(rows, k.dim(t)), k.dim(d + dv + ROW_COST))
        with k.parallel_loop(b.mul(count, blocks), cost=cost, name="attn",
                             carry=[k.scratch, rows, blocks]) as task:
            scratch, rows_c, blocks_c = k.carried
            self._task(node, k, batch, (s, d, t), task, scratch, rows_c, blocks_c)

    def _task(self, node: Node, k: Emitter, batch: tuple[Dim, ...],
              sizes: tuple[Dim, Dim, Dim], task: ir.Value, scratch: ir.Value,
              rows: ir.Value, blocks: ir.Value) -> None:
        s, d, t = sizes
        b = k.b
        entry, block = b.sdiv(task, blocks), b.srem(task, blocks)
        index = k.unravel(entry, batch)
        q, k_t, v = (matrix_at(k, broadcast_batch(k, _view(k, node, i), batch), index)
                     for i in (Q, K_T, V))
        y = matrix_at(k, _view(k, node, OUT), index)
        first = b.mul(block, rows)
        n_rows = k.minimum("int64", rows, b.sub(k.dim(s), first))
        t_v = k.dim(t)
        scores = b.gep(scratch, [b.mul(b.mul(k.task_first, rows), t_v)], source_etype=F32)
        emit_gemm(k, n_rows, t_v, k.dim(d), k.element_ptr(q, b.mul(first, q.strides[0])),
                  q.strides[0], k_t.ptr, k_t.strides[0], scores, t_v)
        mask = self._mask(node, k, batch, s, t, index)
        with k.loop(n_rows, name="row") as r:
            row = b.gep(scores, [b.mul(r, t_v)], source_etype=F32)
            self._scale_and_mask(node, k, row, t_v, mask, b.add(first, r))
            emit_softmax_row(k, row, row, t_v)
        emit_gemm(k, n_rows, y.dims[1], t_v, scores, t_v, v.ptr, v.strides[0],
                  k.element_ptr(y, b.mul(first, y.strides[0])), y.strides[0])

    @staticmethod
    def _mask(node: Node, k: Emitter, batch: tuple[Dim, ...], s: Dim, t: Dim,
              index: list[ir.Value]) -> View | None:
        """The mask's [s, t] matrix for this batch entry (strides 0 where it broadcasts)."""
        m = node.input(3)
        if m is None:
            return None
        full = k.broadcast_to(k.view(m), (*batch, s, t))
        return matrix_at(k, full, index)

    @staticmethod
    def _scale_and_mask(node: Node, k: Emitter, row: ir.Value, t: ir.Value,
                        mask: View | None, query: ir.Value) -> None:
        """row[j] = row[j] (* or /) scale (+ mask[query, j]), as the graph's Mul or Div and
        Add compute them."""
        scale = attr(node, SCALE, None)
        if scale is None and mask is None:
            return
        b = k.b
        divide = attr(node, SCALE_OP, "Mul") == "Div"
        mask_row = (replace(mask, ptr=k.element_ptr(mask, b.mul(query, mask.strides[0])))
                    if mask is not None else None)
        with k.loop(t, name="col") as j:
            p = b.gep(row, [j], source_etype=F32, inbounds=True)
            x = b.load(p, typ=F32)
            if scale is not None:
                c = ir.Constant(F32, float(scale))
                x = b.fdiv(x, c) if divide else b.fmul(x, c)
            if mask_row is not None:
                x = b.fadd(x, k.load_at(mask_row, b.mul(j, mask_row.strides[1])))
            b.store(x, p)
