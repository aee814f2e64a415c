"""Matrix products: Gemm and MatMul (with numpy batch broadcasting).

float32 products with contiguous rows run on the shared kernels: at most MAX_ROWS rows of A on
the matrix-vector one (kernels/gemv.py: batch-1 Linear layers are bound by reading the
weight), more on the tiled GEMM (kernels/gemm.py); a symbolic row count picks one at
run time. Otherwise float32 and float64 use `emit_matmul` (rows of the output updated in
place) unless the right operand is stored transposed (`prefers_dot`); float16 sums each output
element in a float32 register (`emit_matmul_dot`) and rounds it once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value
from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.bf16_gemm import (
    bf16_or_float32,
    emit_float32_panels,
    emit_parallel_bf16_gemm,
)
from cuvil.compiler.kernels.emitter import Emitter, View
from cuvil.compiler.kernels.gemm import (
    PLAIN,
    ROW_MAJOR,
    Epilogue,
    Layout,
    emit_gemm,
    emit_parallel_gemm,
)
from cuvil.compiler.kernels.gemv import MAX_ROWS, emit_parallel_gemv
from cuvil.compiler.ops import (
    FLOATS,
    UNCHECKED,
    InferContext,
    Op,
    attr,
    broadcast_shapes,
    compute_dtype,
    register,
    required_input,
)
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError


def emit_matmul(k: Emitter, a: View, b: View, y: View, alpha: float = 1.0,
                accumulate: bool = False) -> None:
    """y[M,N] (+)= alpha * a[M,K] @ b[K,N] on 2-D views with any strides.

    The loop order i, k, j walks rows of b and y contiguously, so the inner loop vectorizes
    without reassociating sums (results match a plain dot product closely).
    """
    m, kk = a.dims
    n = b.dims[1]
    dtype = y.dtype
    zero = k.const(dtype, 0.0)
    with k.loop(m, name="m") as i:
        if not accumulate:
            with k.loop(n, name="n0") as j:
                k.store(y, [i, j], zero)
        with k.loop(kk, name="k") as p:
            av = k.load(a, [i, p])
            if alpha != 1.0:
                av = k.b.fmul(av, k.const(dtype, alpha))
            with k.loop(n, name="n") as j:
                acc = k.load(y, [i, j])
                k.store(y, [i, j], k.fmul_add(av, k.load(b, [p, j]), acc))


def emit_matmul_dot(k: Emitter, a: View, b: View, y: View, alpha: float = 1.0,
                    c: View | None = None, beta: float = 1.0) -> None:
    """y[M,N] = alpha * a[M,K] @ b[K,N] (+ beta * c[M,N]), each element summed in a register of
    the compute dtype (float32 for float16 operands) and rounded once."""
    m, kk = a.dims
    n = b.dims[1]
    ct = compute_dtype(y.dtype)
    bld = k.b
    acc = entry_alloca(k, k.const(ct, 0.0).type, "acc")
    with k.loop(m, name="m") as i, k.loop(n, name="n") as j:
        bld.store(k.const(ct, 0.0), acc)
        with k.loop(kk, name="k") as p:
            av = k.convert(k.load(a, [i, p]), a.dtype, ct)
            bv = k.convert(k.load(b, [p, j]), b.dtype, ct)
            bld.store(k.fmul_add(av, bv, bld.load(acc)), acc)
        result = bld.load(acc)
        if alpha != 1.0:
            result = bld.fmul(result, k.const(ct, alpha))
        if c is not None:
            cv = k.convert(k.load(c, [i, j]), c.dtype, ct)
            if beta != 1.0:
                cv = bld.fmul(cv, k.const(ct, beta))
            result = bld.fadd(result, cv)
        k.store(y, [i, j], k.convert(result, ct, y.dtype))


def _unit(stride: ir.Value) -> bool:
    return isinstance(stride, ir.Constant) and int(stride.constant) == 1


def prefers_dot(a: View, b: View) -> bool:
    """True when b[K,N] is strided along N but both operands are contiguous along K (b is a
    transposed matrix read at run time, as in attention scores): then summing dot products
    reads memory in order, where `emit_matmul` would stride through b."""
    return not _unit(b.strides[1]) and _unit(a.strides[1]) and _unit(b.strides[0])


#: attributes the fusion pass (passes/fuse_epilogue.py) sets on Conv, Gemm and MatMul: an
#: activation of kernels/activation.py and its parameters, applied in the kernel's epilogue
FUSED_ACTIVATION = "cuvil.fused_activation"
ACTIVATION_PARAMS = "cuvil.activation_params"
#: input slot of a fused residual: a tensor of the output's type, added before the activation
RESIDUAL_SLOT = 3
#: MatMul's input slot for a fused bias (one value per output column, added first)
MATMUL_BIAS_SLOT = 2
#: attribute passes/pack_gemm_weights.py sets when the constant weight (input 1) holds the
#: kernel's packed layout: `pack_a` panels per group for Conv, `pack_b` for Gemm and MatMul
PACKED_WEIGHTS = "cuvil.packed_weights"
#: attribute passes/bf16_weights.py sets (precision = "bf16") when the weight (input 1) holds
#: bf16 packed for kernels/bf16_gemm.py (`pack_l` per group for Conv, `pack_r` for
#: Gemm and MatMul; its bits in a float32-typed 1-D constant): the weight's own shape
BF16_WEIGHTS = "cuvil.bf16_weights"


def logical_weight(node: Node) -> Value:
    """Input 1 of a product, or for bf16 weights a stand-in of the shape and dtype the packed
    constant replaced (what shape rules and lowerings read; buffers come from the input)."""
    w = required_input(node, 1)
    shape = node.attrs.get(BF16_WEIGHTS)
    if shape is None:
        return w
    return Value(w.name, TensorType(np.dtype(np.float32), tuple(int(d) for d in shape)))


def weight_layout(node: Node, operand: str) -> Layout:
    """The kernel layout of a product node whose weight is its `operand` ("a" or "b")."""
    if not node.attrs.get(PACKED_WEIGHTS):
        return ROW_MAJOR
    return Layout(packed_a=operand == "a", packed_b=operand == "b")


def node_epilogue(node: Node, bias: str = "none") -> Epilogue:
    """The epilogue a (fused) Conv, Gemm or MatMul asks for, with a bias of kind `bias`."""
    return Epilogue(bias, residual=node.input(RESIDUAL_SLOT) is not None,
                    activation=node.attrs.get(FUSED_ACTIVATION),
                    params=tuple(node.attrs.get(ACTIVATION_PARAMS, ())))


def check_fused_inputs(node: Node, out: TensorType) -> None:
    """Shape rule for the inputs fusion adds: a residual exactly of the output's type."""
    r = node.input(RESIDUAL_SLOT)
    if r is not None and (r.type.dtype != out.dtype or r.type.shape != out.shape):
        raise ModelError(f"{node.describe()}: the fused residual {r.name!r} is {r.type}, "
                         f"not the output's {out}")


def apply_epilogue(k: Emitter, y: View, epilogue: Epilogue, residual: View | None = None,
                   col_bias: View | None = None) -> None:
    """y = act(y + bias + residual) element by element: the epilogue of products that do not
    run on the kernel (strided operands)."""
    with k.loops(y.dims, name="ep") as idx:
        v = k.load(y, idx)
        if col_bias is not None:
            v = k.b.fadd(v, k.load(col_bias, idx[-1:]))
        if residual is not None:
            v = k.b.fadd(v, k.load(residual, idx))
        if epilogue.activation is not None:
            v = apply_activation(k.b, epilogue.activation, epilogue.params, v)
        k.store(y, idx, v)


def uses_kernel(a: View, b: View, y: View) -> bool:
    """float32 products whose operands' rows are contiguous run on the shared GEMM kernel."""
    return (y.dtype.name == "float32" and _unit(a.strides[1]) and _unit(b.strides[1])
            and _unit(y.strides[1]))


def gemv_layout(a: View, b: View, y: View, layout: Layout = ROW_MAJOR) -> str | None:
    """How the matrix-vector kernel (kernels/gemv.py) would read b, when it can: float32
    with rows of a and y contiguous, and b packed, row-major or a transposed row-major matrix."""
    if y.dtype.name != "float32" or not (_unit(a.strides[1]) and _unit(y.strides[1])):
        return None
    if layout.packed_b:
        return "packed"
    if _unit(b.strides[1]):
        return "rows"
    return "transposed" if _unit(b.strides[0]) else None


def few_rows_or(k: Emitter, m: ir.Value, few: Callable[[], None],
                many: Callable[[], None]) -> None:
    """few() when 1 <= m <= MAX_ROWS, else many(): decided at compile time when m is a
    constant, at run time otherwise (a symbolic batch that is 1 in one call, 8 in another)."""
    if isinstance(m, ir.Constant):
        (few if 1 <= int(m.constant) <= MAX_ROWS else many)()
        return
    b = k.b
    cond = b.and_(b.icmp_signed(">=", m, k.i64(1)), b.icmp_signed("<=", m, k.i64(MAX_ROWS)))
    with b.if_else(cond) as (then, otherwise):
        with then:
            few()
        with otherwise:
            many()


def emit_kernel_matmul(k: Emitter, a: View, b: View, y: View, *, accumulate: bool = False,
                       bias: ir.Value | None = None, residual: ir.Value | None = None,
                       epilogue: Epilogue = PLAIN, layout: Layout = ROW_MAJOR) -> None:
    """y = a @ b (+ y) (+ bias) (+ residual, laid out like y) on the shared, threaded GEMM
    kernel (`uses_kernel` holds)."""
    emit_parallel_gemm(k, a.dims[0], b.dims[1], a.dims[1], a.ptr, a.strides[0], b.ptr,
                       b.strides[0], y.ptr, y.strides[0], accumulate=accumulate, bias=bias,
                       residual=residual, epilogue=epilogue, layout=layout)


def _check_same_dtype(node: Node) -> None:
    dtypes = {v.type.dtype for v in node.inputs if v is not None}
    if len(dtypes) > 1:
        raise ModelError(f"{node.describe()}: inputs have different dtypes "
                         f"({', '.join(sorted(str(d) for d in dtypes))}); they must match")


def _transposed(v: View) -> View:
    return replace(v, dims=v.dims[::-1], strides=v.strides[::-1], shape=v.shape[::-1])


class _WeightProduct(Op):
    """Gemm and MatMul: with bf16 weights (`BF16_WEIGHTS`), CPUs without bf16 instructions
    multiply on float32 panels the first run derives from them (kernels/bf16_gemm.py)."""

    def path(self, node: Node) -> str:
        return "bf16" if BF16_WEIGHTS in node.attrs else ""

    def derived_bytes(self, node: Node) -> int:
        return int(logical_weight(node).type.nbytes) if BF16_WEIGHTS in node.attrs else 0

    def derived_on_demand(self, node: Node) -> bool:
        return BF16_WEIGHTS in node.attrs

    def lower_derived(self, node: Node, k: Emitter) -> None:
        """B's float32 panels (`pack_b`) from its bf16 ones, where the CPU runs the float32
        path."""
        kk, n = logical_weight(node).type.shape[-2:]
        assert k.derived is not None
        emit_float32_panels(k, "b", k.buffers[required_input(node, 1)], k.derived, int(kk),
                            int(n))


@register
class Gemm(_WeightProduct):
    """Y = alpha * A' @ B' + beta * C, with A' and B' optionally transposed."""

    op_type = "Gemm"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _check_same_dtype(node)
        a, b = required_input(node, 0), logical_weight(node)
        if a.type.rank != 2 or b.type.rank != 2:
            raise ModelError(f"{node.describe()}: Gemm needs 2-D inputs, got {a.type} and {b.type}")
        m, ka = a.type.shape[::-1] if attr(node, "transA") else a.type.shape
        kb, n = b.type.shape[::-1] if attr(node, "transB") else b.type.shape
        ctx.dims_equal(node, ka, kb, "inner dims of A and B")
        c = node.input(2)
        if c is not None:
            if c.type.rank > 2:
                raise ModelError(f"{node.describe()}: C {c.type} must have rank <= 2 (it is "
                                 f"broadcast to the [{m}, {n}] output)")
            out = broadcast_shapes(node, ctx, (m, n), c.type.shape)
            ctx.dims_equal(node, out[0], m, "C rows")
            ctx.dims_equal(node, out[1], n, "C columns")
        y = TensorType(a.type.dtype, (m, n))
        check_fused_inputs(node, y)
        return [y]

    def lower(self, node: Node, k: Emitter) -> None:
        if BF16_WEIGHTS in node.attrs:
            _lower_gemm_bf16(node, k)
            return
        a_val, b_val = required_input(node, 0), required_input(node, 1)
        a, b, y = k.view(a_val), k.view(b_val), k.view(node.outputs[0])
        if attr(node, "transA"):
            a = _transposed(a)
        if attr(node, "transB"):
            b = _transposed(b)
        gemv = gemv_layout(a, b, y, weight_layout(node, "b"))
        if gemv is None:
            self._lower_general(node, k, a, b, y)
            return
        few_rows_or(k, a.dims[0], lambda: self._lower_gemv(node, k, a, b, y, gemv),
                    lambda: self._lower_general(node, k, a, b, y))

    def _lower_gemv(self, node: Node, k: Emitter, a: View, b: View, y: View,
                    layout: str) -> None:
        """At most MAX_ROWS rows: the matrix-vector kernel, alpha, C and the activation fused."""
        c_val, y_val, r_val = node.input(2), node.outputs[0], node.input(RESIDUAL_SLOT)
        beta = float(attr(node, "beta"))
        accumulate = c_val is not None and beta != 0.0
        bias_kind = _bias_kind(c_val, y_val.type.shape) if accumulate and beta == 1.0 else None
        if accumulate and bias_kind is None:
            _fill_scaled(k, c_val, y, y_val.type.shape, beta)
        ldb = b.strides[1] if layout == "transposed" else b.strides[0]
        emit_parallel_gemv(
            k, a.dims[0], b.dims[1], a.dims[1], a.ptr, a.strides[0], b.ptr, ldb, y.ptr,
            y.strides[0], layout=layout, accumulate=accumulate and bias_kind is None,
            bias=k.buffers[c_val] if bias_kind is not None and c_val is not None else None,
            residual=k.buffers[r_val] if r_val is not None else None,
            epilogue=replace(node_epilogue(node), bias=bias_kind or "none"),
            alpha=float(attr(node, "alpha")))

    def _lower_general(self, node: Node, k: Emitter, a: View, b: View, y: View) -> None:
        c_val, y_val = node.input(2), node.outputs[0]
        alpha = float(attr(node, "alpha"))
        beta = float(attr(node, "beta"))
        accumulate = c_val is not None and beta != 0.0
        epilogue, r_val = node_epilogue(node), node.input(RESIDUAL_SLOT)
        layout = weight_layout(node, "b")
        assert layout == ROW_MAJOR or (alpha == 1.0 and uses_kernel(a, b, y)), \
            "packed weights only for the kernel path (passes/pack_gemm_weights.py)"
        if alpha == 1.0 and uses_kernel(a, b, y):
            residual = k.buffers[r_val] if r_val is not None else None
            bias_kind = _bias_kind(c_val, y_val.type.shape) if accumulate and beta == 1.0 else None
            if bias_kind is not None:
                assert c_val is not None
                emit_kernel_matmul(k, a, b, y, bias=k.buffers[c_val], residual=residual,
                                   epilogue=replace(epilogue, bias=bias_kind), layout=layout)
                return
            if accumulate:
                _fill_scaled(k, c_val, y, y_val.type.shape, beta)
            emit_kernel_matmul(k, a, b, y, accumulate=accumulate, residual=residual,
                               epilogue=epilogue, layout=layout)
            return
        if compute_dtype(y.dtype) != y.dtype or prefers_dot(a, b):
            c = (k.broadcast_to(k.view(c_val), y_val.type.shape)
                 if accumulate and c_val is not None else None)
            emit_matmul_dot(k, a, b, y, alpha=alpha, c=c, beta=beta)
        else:
            if accumulate:
                _fill_scaled(k, c_val, y, y_val.type.shape, beta)
            emit_matmul(k, a, b, y, alpha=alpha, accumulate=accumulate)
        if epilogue != PLAIN:
            apply_epilogue(k, y, epilogue, k.view(r_val) if r_val is not None else None)


def _lower_gemm_bf16(node: Node, k: Emitter) -> None:
    """A Gemm with bf16 weights (alpha = 1, A not transposed: the kernel's path)."""
    a_val, c_val, y_val = required_input(node, 0), node.input(2), node.outputs[0]
    b_shape = logical_weight(node).type.shape
    beta = float(attr(node, "beta"))
    accumulate = c_val is not None and beta != 0.0
    bias_kind = _bias_kind(c_val, y_val.type.shape) if accumulate and beta == 1.0 else None
    y = k.view(y_val)
    if accumulate and bias_kind is None:
        _fill_scaled(k, c_val, y, y_val.type.shape, beta)
    r_val = node.input(RESIDUAL_SLOT)
    kk, n = k.dim(b_shape[0]), k.dim(b_shape[1])
    _bf16_product(k, (k.dim(y_val.type.shape[0]), n, kk, k.buffers[a_val], kk,
                      k.buffers[required_input(node, 1)], n, k.buffers[y_val], n),
                  accumulate=accumulate and bias_kind is None,
                  bias=k.buffers[c_val] if bias_kind is not None and c_val is not None else None,
                  residual=k.buffers[r_val] if r_val is not None else None,
                  epilogue=replace(node_epilogue(node), bias=bias_kind or "none"))


def _bf16_product(k: Emitter, args: tuple[ir.Value, ...], *, accumulate: bool,
                  bias: ir.Value | None, residual: ir.Value | None, epilogue: Epilogue) -> None:
    """C = A @ B of a Gemm or MatMul with bf16 weights, args = (M, N, K, A, lda, B, ldb, C,
    ldc): on the bf16 kernel where the CPU has bf16 instructions, else as float32 weights
    would run, on the float32 panels derived from B (`_WeightProduct.lower_derived`)."""
    assert k.derived is not None
    on_panels = (*args[:5], k.derived, *args[6:])
    bf16_or_float32(
        k, lambda: emit_parallel_bf16_gemm(k, *args, side="b", accumulate=accumulate, bias=bias,
                                           residual=residual, epilogue=epilogue),
        lambda: _float32_product(k, on_panels, Layout(packed_b=True), accumulate=accumulate,
                                 bias=bias, residual=residual, epilogue=epilogue))


def _float32_product(k: Emitter, args: tuple[ir.Value, ...], layout: Layout, *,
                     accumulate: bool = False, bias: ir.Value | None,
                     residual: ir.Value | None, epilogue: Epilogue) -> None:
    """C = A @ B, args = (M, N, K, A, lda, B, ldb, C, ldc), B row-major or packed (`layout`): on
    the matrix-vector kernel for a few rows, else on the GEMM kernel."""
    few_rows_or(k, args[0],
                lambda: emit_parallel_gemv(k, *args, layout="packed" if layout.packed_b
                                           else "rows", accumulate=accumulate, bias=bias,
                                           residual=residual, epilogue=epilogue),
                lambda: emit_parallel_gemm(k, *args, accumulate=accumulate, bias=bias,
                                           residual=residual, epilogue=epilogue, layout=layout))


def _bias_kind(c: Value | None, out: tuple[Dim, ...]) -> str | None:
    """"col" when C is one value per output column, "row" when one per row, else None."""
    if c is None:
        return None
    shape = tuple(c.type.shape)
    n, m = out[1], out[0]
    if shape in ((n,), (1, n)) and not (n == 1 and m != 1):
        return "col"
    if shape == (m, 1) and m != 1:
        return "row"
    return None


def _fill_scaled(k: Emitter, c_val: Value | None, y: View, shape: tuple[Dim, ...],
                 beta: float) -> None:
    """y = beta * C broadcast to y's shape, before a product accumulates into it."""
    assert c_val is not None
    c = k.broadcast_to(k.view(c_val), shape)
    with k.loops(y.dims) as idx:
        cv = k.load(c, idx)
        if beta != 1.0:
            cv = k.b.fmul(cv, k.const(y.dtype, beta))
        k.store(y, idx, cv)


@register
class MatMul(_WeightProduct):
    """numpy.matmul semantics: 1-D operands are promoted, batch dims broadcast."""

    op_type = "MatMul"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _check_same_dtype(node)
        a, b = required_input(node, 0), logical_weight(node)
        sa, sb = a.type.shape, b.type.shape
        if not sa or not sb:
            raise ModelError(f"{node.describe()}: MatMul inputs must have rank >= 1")
        a2 = (1, *sa) if len(sa) == 1 else sa
        b2 = (*sb, 1) if len(sb) == 1 else sb
        ctx.dims_equal(node, a2[-1], b2[-2], "inner dims of A and B")
        batch = broadcast_shapes(node, ctx, a2[:-2], b2[:-2])
        out: tuple[Dim, ...] = (*batch, a2[-2], b2[-1])
        if len(sa) == 1:
            out = out[:-2] + out[-1:]
        if len(sb) == 1:
            out = out[:-1]
        y = TensorType(a.type.dtype, out)
        bias = node.input(MATMUL_BIAS_SLOT)
        if bias is not None and (len(sa) < 2 or len(sb) < 2 or bias.type.dtype != y.dtype
                                 or bias.type.shape != out[-1:]):
            raise ModelError(f"{node.describe()}: the fused bias {bias.name!r} is {bias.type}; "
                             f"it must be one value per output column of matrices ({y})")
        check_fused_inputs(node, y)
        return [y]

    def lower(self, node: Node, k: Emitter) -> None:
        if on_one_gemm(node):
            _lower_one_gemm(node, k)
            return
        if _on_batched_kernel(node):
            _lower_batched_kernel(node, k)
            return
        a, b, y_full, batch_shape = _operands(node, k)
        dot = (compute_dtype(y_full.dtype) != y_full.dtype
               or prefers_dot(matrix_at(k, a, None), matrix_at(k, b, None)))
        kernel = emit_matmul_dot if dot else emit_matmul
        with k.loops([k.dim(d) for d in batch_shape], name="batch") as idx:
            kernel(k, matrix_at(k, a, idx), matrix_at(k, b, idx), matrix_at(k, y_full, idx))
        epilogue = node_epilogue(node)
        bias_val = node.input(MATMUL_BIAS_SLOT)
        if epilogue != PLAIN or bias_val is not None:
            apply_epilogue(k, y_full, epilogue, _residual(node, k, y_full),
                           k.view(bias_val) if bias_val is not None else None)


#: batches fewer than this run one after the other, each split over the threads; more run
#: one matrix per task
MIN_PARALLEL_BATCH = 4


def on_one_gemm(node: Node) -> bool:
    """float32 MatMul whose B is one matrix for every batch entry (a Linear layer: [..., K] x
    [K, N]): A's batch dims and rows are contiguous, so it is one [batch * M, K] x [K, N]
    product on the threaded kernel."""
    b = logical_weight(node) if node.inputs[1] is not None else None
    return (node.outputs[0].type.dtype.name == "float32" and b is not None and b.type.rank >= 2
            and all(isinstance(d, int) and d == 1 for d in b.type.shape[:-2]))


def _on_batched_kernel(node: Node) -> bool:
    a, b = node.inputs[0], node.inputs[1]
    return (node.outputs[0].type.dtype.name == "float32" and a is not None and b is not None
            and a.type.rank >= 2 and b.type.rank >= 2)


def _matmul_epilogue(node: Node, k: Emitter) -> tuple[Epilogue, ir.Value | None]:
    """The fused epilogue of a MatMul on the kernel, and its bias pointer (one per column)."""
    bias = node.input(MATMUL_BIAS_SLOT)
    epilogue = node_epilogue(node, "col" if bias is not None else "none")
    return epilogue, k.buffers[bias] if bias is not None else None


def _residual(node: Node, k: Emitter, y_full: View) -> View | None:
    """The fused residual (of y's shape) viewed with y_full's layout."""
    r = node.input(RESIDUAL_SLOT)
    return k.contiguous(k.buffers[r], y_full.dtype, y_full.shape) if r is not None else None


def _lower_one_gemm(node: Node, k: Emitter) -> None:
    a_val, b_val = required_input(node, 0), logical_weight(node)
    r_val = node.input(RESIDUAL_SLOT)
    kk, n = b_val.type.shape[-2], b_val.type.shape[-1]
    rows: Dim = 1
    for d in a_val.type.shape[:-1]:
        rows = rows * d
    epilogue, bias = _matmul_epilogue(node, k)
    zero_if_empty(k, node.outputs[0], kk)
    layout = weight_layout(node, "b")
    args = (k.dim(rows), k.dim(n), k.dim(kk), k.buffers[a_val], k.dim(kk),
            k.buffers[required_input(node, 1)], k.dim(n), k.buffers[node.outputs[0]], k.dim(n))
    residual = k.buffers[r_val] if r_val is not None else None
    if BF16_WEIGHTS in node.attrs:
        _bf16_product(k, args, accumulate=False, bias=bias, residual=residual,
                      epilogue=epilogue)
        return
    _float32_product(k, args, layout, bias=bias, residual=residual, epilogue=epilogue)


def _lower_batched_kernel(node: Node, k: Emitter) -> None:
    """Batched products of contiguous matrices (attention's Q @ K^T and P @ V): one matrix per
    task on the kernel, or, for few batch entries, each product split over the threads."""
    a_val, b_val = required_input(node, 0), required_input(node, 1)
    batch_shape = broadcast_shapes(node, UNCHECKED, a_val.type.shape[:-2], b_val.type.shape[:-2])
    count: Dim = 1
    for d in batch_shape:
        count = count * d
    m, kk, n = a_val.type.shape[-2], a_val.type.shape[-1], b_val.type.shape[-1]
    epilogue, bias = _matmul_epilogue(node, k)
    bld = k.b
    count_v = k.dim(count)
    zero_if_empty(k, node.outputs[0], kk)

    def matrices(t: ir.Value) -> tuple[View, View, View, ir.Value | None]:
        a, b, y, _ = _operands(node, k)
        r = _residual(node, k, y)
        idx = k.unravel(t, batch_shape)
        am, bm, ym = (matrix_at(k, v, idx) for v in (a, b, y))
        return am, bm, ym, matrix_at(k, r, idx).ptr if r is not None else None

    with bld.if_else(bld.icmp_signed("<", count_v, k.i64(MIN_PARALLEL_BATCH))) as (few, many):
        with few, k.loop(count_v, name="batch") as t:
            am, bm, ym, rm = matrices(t)
            emit_parallel_gemm(k, am.dims[0], bm.dims[1], am.dims[1], am.ptr, am.strides[0],
                               bm.ptr, bm.strides[0], ym.ptr, ym.strides[0], bias=bias,
                               residual=rm, epilogue=epilogue)
        with many, k.parallel_loop(count, cost=m * n * kk, name="batch") as t:
            am, bm, ym, rm = matrices(t)
            emit_gemm(k, am.dims[0], bm.dims[1], am.dims[1], am.ptr, am.strides[0], bm.ptr,
                      bm.strides[0], ym.ptr, ym.strides[0], bias=bias, residual=rm,
                      epilogue=epilogue)


def zero_if_empty(k: Emitter, y: Value, kk: Dim) -> None:
    """An empty sum (K = 0) is 0: the kernel, which loops over K, would not write Y at all."""
    if isinstance(kk, int) and kk > 0:
        return
    with k.if_then(k.b.icmp_signed("==", k.dim(kk), k.i64(0))):
        k.memset(k.buffers[y], 0, k.dim(y.type.nbytes))


def _operands(node: Node, k: Emitter) -> tuple[View, View, View, tuple[Dim, ...]]:
    """Views of A, B and Y with 1-D operands promoted to matrices and batch dims broadcast
    to the output's (Y as batch x M x N whatever operands were promoted)."""
    a_val, b_val = required_input(node, 0), required_input(node, 1)
    a, b, y = k.view(a_val), k.view(b_val), k.view(node.outputs[0])
    one = k.i64(1)
    zero = k.i64(0)
    # promote 1-D operands to matrices: [K] -> [1,K] for a, [K] -> [K,1] for b
    if a.rank == 1:
        a = replace(a, dims=(one, *a.dims), strides=(zero, *a.strides), shape=(1, *a.shape))
    if b.rank == 1:
        b = replace(b, dims=(*b.dims, one), strides=(*b.strides, zero), shape=(*b.shape, 1))
    batch_shape = broadcast_shapes(node, UNCHECKED, a.shape[:-2], b.shape[:-2])
    y_full = k.contiguous(y.ptr, y.dtype, (*batch_shape, a.shape[-2], b.shape[-1]))
    return (broadcast_batch(k, a, batch_shape), broadcast_batch(k, b, batch_shape), y_full,
            batch_shape)


def broadcast_batch(k: Emitter, v: View, batch: tuple[Dim, ...]) -> View:
    """Broadcast the batch dims of a [..., R, C] view to `batch`."""
    head = View(v.ptr, v.dtype, v.dims[:-2], v.strides[:-2], v.shape[:-2])
    hb = k.broadcast_to(head, batch)
    return replace(v, dims=(*hb.dims, *v.dims[-2:]), strides=(*hb.strides, *v.strides[-2:]),
                   shape=(*batch, *v.shape[-2:]))


def matrix_at(k: Emitter, v: View, batch_index: list[ir.Value] | None) -> View:
    """The 2-D matrix of `v` at a batch index (None: the first one's layout, for decisions)."""
    if batch_index is None:
        return replace(v, dims=v.dims[-2:], strides=v.strides[-2:], shape=v.shape[-2:])
    if not batch_index:
        return v
    off = k.offset(replace(v, strides=v.strides[: len(batch_index)]), batch_index)
    return replace(v, ptr=k.element_ptr(v, off), dims=v.dims[-2:], strides=v.strides[-2:],
                   shape=v.shape[-2:])
