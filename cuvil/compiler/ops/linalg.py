"""Linear algebra on (batches of) square matrices: Det.

Matrix products live in `gemm`; this family holds the factorizations.
"""

from __future__ import annotations

from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, numel, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter, llvm_type
from cuvil.compiler.ops import InferContext, Op, compute_dtype, register, required_input
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError


@register
class Det(Op):
    """The determinant of each M x M matrix of X [..., M, M] by LU factorization with partial
    pivoting (in float32 for float16 and float32, float64 for float64), on a copy of the matrix
    in the node's scratch memory. A pivot column of zeros makes the determinant 0."""

    op_type = "Det"
    since = 11
    dtypes = ("float32", "float64", "float16")

    def _matrix(self, node: Node, ctx: InferContext | None = None) -> tuple[tuple[Dim, ...], Dim]:
        x = node.inputs[0]
        if x is None:
            raise ModelError(f"{node.describe()}: input X is required")
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: X must be [..., M, M], got {x.type}")
        rows, cols = x.type.shape[-2:]
        if ctx is not None:
            ctx.dims_equal(node, rows, cols, "X's matrices must be square (last two dims)")
        return x.type.shape[:-2], rows

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        batch, _ = self._matrix(node, ctx)
        x = required_input(node, 0)
        return [TensorType(x.type.dtype, batch)]

    def scratch_bytes(self, node: Node) -> Dim:
        x = required_input(node, 0)
        _, m = self._matrix(node)
        return simplify_dim(m * m * compute_dtype(x.type.dtype).itemsize)

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, out = node.inputs[0], node.outputs[0]
        assert x_val is not None and k.scratch is not None
        batch, m = self._matrix(node)
        dtype = x_val.type.dtype
        ct = compute_dtype(dtype)
        ty = llvm_type(ct)
        b = k.b
        count = numel(batch)
        xv = k.contiguous(k.buffers[x_val], dtype, (count, m, m))
        yv = k.contiguous(k.buffers[out], dtype, (count,))
        a = k.contiguous(k.scratch, ct, (m, m))
        n = a.dims[0]
        zero, one = ir.Constant(ty, 0.0), ir.Constant(ty, 1.0)
        det = entry_alloca(k, ty, "det")
        pivot_row = entry_alloca(k, I64, "pivot_row")
        pivot_abs = entry_alloca(k, ty, "pivot_abs")

        def fabs(v: ir.Value) -> ir.Value:
            return k.intrinsic("llvm.fabs", [v])

        with k.loop(xv.dims[0], name="batch") as t:
            with k.loop(n, name="r") as r, k.loop(n, name="c") as c:
                k.store(a, [r, c], k.convert(k.load(xv, [t, r, c]), dtype, ct))
            b.store(one, det)
            with k.loop(n, name="j") as j:
                # the largest magnitude in column j at or below the diagonal (first one on ties)
                b.store(j, pivot_row)
                b.store(fabs(k.load(a, [j, j])), pivot_abs)
                with k.loop(n, start=b.add(j, k.i64(1)), name="p") as p:
                    v = fabs(k.load(a, [p, j]))
                    better = b.fcmp_ordered(">", v, b.load(pivot_abs))
                    b.store(b.select(better, v, b.load(pivot_abs)), pivot_abs)
                    b.store(b.select(better, p, b.load(pivot_row)), pivot_row)
                pr = b.load(pivot_row)
                with k.if_then(b.icmp_signed("!=", pr, j)):
                    with k.loop(n, name="s") as c:
                        upper, lower = k.load(a, [j, c]), k.load(a, [pr, c])
                        k.store(a, [j, c], lower)
                        k.store(a, [pr, c], upper)
                    b.store(b.fneg(b.load(det)), det)
                pivot = k.load(a, [j, j])
                b.store(b.fmul(b.load(det), pivot), det)
                # a zero pivot: the column below is zero too, the determinant is 0 already
                with k.if_then(b.fcmp_unordered("!=", pivot, zero)), \
                        k.loop(n, start=b.add(j, k.i64(1)), name="i") as i:
                    f = b.fdiv(k.load(a, [i, j]), pivot)
                    with k.loop(n, start=b.add(j, k.i64(1)), name="e") as c:
                        k.store(a, [i, c], b.fsub(k.load(a, [i, c]), b.fmul(f, k.load(a, [j, c]))))
            k.store(yv, [t], k.convert(b.load(det), ct, dtype))
