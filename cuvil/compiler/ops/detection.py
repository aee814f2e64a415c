"""Detection post-processing: NonMaxSuppression.

Its output, one (batch, class, box) row per kept box, has a data-dependent row count
(`ir.DataDim`) of at most batch x classes x min(max_output_boxes_per_class, boxes); with
`max_output_boxes_per_class` computed at run time, of at most batch x classes x boxes. The
thresholds and the box limit may be constants or run-time inputs.

Per (batch, class), the boxes scoring above the threshold go into a heap by score (the lower
box index first among equal scores), popped while boxes are wanted: each is taken unless their IoU with a box
already kept in the class exceeds the threshold, as onnxruntime and onnx's reference do.
"""

from __future__ import annotations

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter
from cuvil.compiler.ops import InferContext, Op, attr, register, required_input
from cuvil.compiler.ops.indexing import _break_if, _entry_alloca, _forever
from cuvil.compiler.ops.selection import heap_pop, heapify
from cuvil.errors import ModelError

INT64 = np.dtype(np.int64)
F32 = ir.FloatType()


def _scalar_input(node: Node, i: int, what: str, dtypes: tuple[str, ...]) -> Value | None:
    v = node.input(i)
    if v is None:
        return None
    if v.type.dtype.name not in dtypes or v.type.numel not in (0, 1):
        raise ModelError(f"{node.describe()}: {what} {v.name!r} must be one {' or '.join(dtypes)} "
                         f"value, got {v.type}")
    return v if v.type.numel == 1 else None  # an empty tensor: as if left out


def _const_scalar(v: Value | None) -> float | None:
    return None if v is None or v.const is None else np.asarray(v.const).reshape(-1)[0].item()


@register
class NonMaxSuppression(Op):
    op_type = "NonMaxSuppression"
    since = 10

    def _max_boxes(self, node: Node, boxes: Dim) -> Dim:
        """The bound of the rows one (batch, class) keeps."""
        limit = _scalar_input(node, 2, "max_output_boxes_per_class", ("int64",))
        if limit is None:
            return 0
        value = _const_scalar(limit)
        if value is None:
            return boxes
        return simplify_dim(sympy.Min(max(int(value), 0), boxes))

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        boxes, scores = required_input(node, 0), required_input(node, 1)
        for v, what in ((boxes, "boxes"), (scores, "scores")):
            if v.type.dtype.name != "float32" or v.type.rank != 3:
                raise ModelError(f"{node.describe()}: {what} {v.name!r} must be a float32 tensor "
                                 f"of rank 3, got {v.type}")
        if boxes.type.shape[2] != 4:
            raise ModelError(f"{node.describe()}: boxes must be [batch, boxes, 4], got "
                             f"{boxes.type}")
        if int(attr(node, "center_point_box")) not in (0, 1):
            raise ModelError(f"{node.describe()}: center_point_box must be 0 or 1")
        batch, count = boxes.type.shape[0], boxes.type.shape[1]
        ctx.dims_equal(node, scores.type.shape[0], batch, "scores and boxes batch")
        ctx.dims_equal(node, scores.type.shape[2], count, "scores and boxes box count")
        _scalar_input(node, 3, "iou_threshold", ("float32",))
        _scalar_input(node, 4, "score_threshold", ("float32",))
        bound = batch * scores.type.shape[1] * self._max_boxes(node, count)
        return [TensorType(INT64, (ctx.data_dim(node, 0, 0, bound), 3))]

    def scratch_bytes(self, node: Node) -> Dim:
        # a class's candidates (int64), and each box's corners and area (float32)
        return simplify_dim(28 * required_input(node, 0).type.shape[1])

    def lower(self, node: Node, k: Emitter) -> None:
        boxes, scores, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        count_dim = boxes.type.shape[1]
        if self._max_boxes(node, count_dim) == 0:
            return
        b = k.b
        nb, nc, ns = (k.dim(boxes.type.shape[0]), k.dim(scores.type.shape[1]), k.dim(count_dim))
        limit = self._scalar(k, _scalar_input(node, 2, "max_output_boxes_per_class", ("int64",)),
                             I64)
        limit = b.select(b.icmp_signed("<", limit, k.i64(0)), k.i64(0), limit)
        iou_v = _scalar_input(node, 3, "iou_threshold", ("float32",))
        iou = self._scalar(k, iou_v, F32) if iou_v is not None else ir.Constant(F32, 0.0)
        score_v = _scalar_input(node, 4, "score_threshold", ("float32",))
        threshold = self._scalar(k, score_v, F32) if score_v is not None else None
        center = int(attr(node, "center_point_box")) == 1
        bp, sp, y = k.buffers[boxes], k.buffers[scores], k.buffers[out]
        assert k.scratch is not None
        cand = k.scratch
        corners = b.gep(k.scratch, [b.mul(ns, k.i64(8))], source_etype=ir.IntType(8),
                        inbounds=True)

        def load(ptr: ir.Value, ty: ir.Type, off: ir.Value) -> ir.Value:
            return b.load(b.gep(ptr, [off], source_etype=ty, inbounds=True), typ=ty)

        def store(ptr: ir.Value, ty: ir.Type, off: ir.Value, v: ir.Value) -> None:
            b.store(v, b.gep(ptr, [off], source_etype=ty, inbounds=True))

        total = _entry_alloca(k, I64, "total")
        b.store(k.i64(0), total)
        m_slot = _entry_alloca(k, I64, "candidates")
        q_slot = _entry_alloca(k, I64, "q")
        with k.loop(nb, name="b") as bi:
            # each box's x_min, x_max, y_min, y_max and area, once per image
            with k.loop(ns, name="corners") as si:
                base = b.mul(b.add(b.mul(bi, ns), si), k.i64(4))
                c = [load(bp, F32, b.add(base, k.i64(t))) for t in range(4)]
                box = _corners(b, c, center)
                area = b.fmul(b.fsub(box[1], box[0]), b.fsub(box[3], box[2]))
                for t, v in enumerate((*box, area)):
                    store(corners, F32, b.add(b.mul(si, k.i64(5)), k.i64(t)), v)
            with k.loop(nc, name="c") as ci:
                row = b.mul(b.add(b.mul(bi, nc), ci), ns)  # scores[bi, ci, :]
                b.store(k.i64(0), m_slot)
                with k.loop(ns, name="s") as si:
                    keep = (b.fcmp_ordered(">", load(sp, F32, b.add(row, si)), threshold)
                            if threshold is not None else ir.Constant(ir.IntType(1), 1))
                    with b.if_then(keep):
                        m = b.load(m_slot)
                        store(cand, I64, m, si)
                        b.store(b.add(m, k.i64(1)), m_slot)

                def better(i: ir.Value, j: ir.Value, row: ir.Value = row) -> ir.Value:
                    si_, sj = load(sp, F32, b.add(row, i)), load(sp, F32, b.add(row, j))
                    return b.or_(b.fcmp_ordered(">", si_, sj),
                                 b.and_(b.fcmp_ordered("==", si_, sj), b.icmp_signed("<", i, j)))

                # a heap of the candidates, popped best first only while boxes are wanted
                heapify(k, cand, b.load(m_slot), better)
                start = b.load(total)
                with _forever(k, "take") as done:
                    left = b.load(m_slot)
                    _break_if(k, b.icmp_signed("<=", left, k.i64(0)), done)
                    _break_if(k, b.icmp_signed(">=", b.sub(b.load(total), start), limit), done)
                    box = heap_pop(k, cand, left, better)
                    b.store(b.sub(left, k.i64(1)), m_slot)
                    b.store(start, q_slot)
                    taken = b.load(total)
                    with _forever(k, "kept") as checked:
                        q = b.load(q_slot)
                        with b.if_then(b.icmp_signed(">=", q, taken)):
                            for j, v in enumerate((bi, ci, box)):  # no kept box suppresses it
                                store(y, I64, b.add(b.mul(taken, k.i64(3)), k.i64(j)), v)
                            b.store(b.add(taken, k.i64(1)), total)
                            b.branch(checked)
                        other = load(y, I64, b.add(b.mul(q, k.i64(3)), k.i64(2)))
                        _break_if_suppressed(k, corners, box, other, iou, checked)
                        b.store(b.add(q, k.i64(1)), q_slot)
        k.set_dim(out.type.shape[0], b.load(total))

    @staticmethod
    def _scalar(k: Emitter, v: Value | None, ty: ir.Type) -> ir.Value:
        assert v is not None
        if v.const is not None:
            value = np.asarray(v.const).reshape(-1)[0].item()
            return ir.Constant(ty, int(value) if ty == I64 else float(value))
        return k.b.load(k.buffers[v], typ=ty)


def _corners(b: ir.IRBuilder, c: list[ir.Value], center: bool) -> tuple[ir.Value, ...]:
    """x_min, x_max, y_min, y_max of a box as onnx's reference computes them."""
    if center:  # [x_center, y_center, width, height]
        half_w = b.fdiv(c[2], ir.Constant(F32, 2.0))
        half_h = b.fdiv(c[3], ir.Constant(F32, 2.0))
        return (b.fsub(c[0], half_w), b.fadd(c[0], half_w),
                b.fsub(c[1], half_h), b.fadd(c[1], half_h))

    def ordered(p: ir.Value, q: ir.Value) -> tuple[ir.Value, ir.Value]:  # either corner first
        swap = b.fcmp_ordered(">=", p, q)
        return b.select(swap, q, p), b.select(swap, p, q)

    x_min, x_max = ordered(c[1], c[3])  # [y1, x1, y2, x2]
    y_min, y_max = ordered(c[0], c[2])
    return (x_min, x_max, y_min, y_max)


def _break_if_suppressed(k: Emitter, corners: ir.Value, i: ir.Value, j: ir.Value,
                         iou: ir.Value, done: ir.Block) -> None:
    """Branch to `done` when box j (kept) suppresses box i: their IoU exceeds the threshold,
    with the reference's checks (no overlap or an empty box: no suppression). Boxes apart
    along x, most pairs, cost four loads and two compares."""
    b = k.b

    def get(n: ir.Value, t: int) -> ir.Value:
        off = b.add(b.mul(n, ir.Constant(I64, 5)), ir.Constant(I64, t))
        return b.load(b.gep(corners, [off], source_etype=F32, inbounds=True), typ=F32)

    def larger(p: ir.Value, q: ir.Value) -> ir.Value:  # Python's max(p, q)
        return b.select(b.fcmp_ordered(">", q, p), q, p)

    def smaller(p: ir.Value, q: ir.Value) -> ir.Value:
        return b.select(b.fcmp_ordered("<", q, p), q, p)

    ix0, ix1 = larger(get(i, 0), get(j, 0)), smaller(get(i, 1), get(j, 1))
    with b.if_then(b.fcmp_ordered(">", ix1, ix0)):
        iy0, iy1 = larger(get(i, 2), get(j, 2)), smaller(get(i, 3), get(j, 3))
        area_a, area_b = get(i, 4), get(j, 4)
        zero = ir.Constant(F32, 0.0)
        inter = b.fmul(b.fsub(ix1, ix0), b.fsub(iy1, iy0))
        union = b.fsub(b.fadd(area_a, area_b), inter)
        conds = [b.fcmp_ordered(">", iy1, iy0), b.fcmp_ordered(">", inter, zero),
                 b.fcmp_ordered(">", area_a, zero), b.fcmp_ordered(">", area_b, zero),
                 b.fcmp_ordered(">", union, zero), b.fcmp_ordered(">", b.fdiv(inter, union), iou)]
        result = conds[0]
        for c in conds[1:]:
            result = b.and_(result, c)
        _break_if(k, result, done)
