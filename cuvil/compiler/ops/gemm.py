"""Matrix products: Gemm and MatMul (with numpy batch broadcasting).

float32 and float64 use `emit_matmul` (rows of the output updated in place) unless the right
operand is stored transposed (`prefers_dot`); float16 sums each output element in a float32
register (`emit_matmul_dot`) and rounds it once.
"""

from __future__ import annotations

from dataclasses import replace

from llvmlite import ir

from cuvil.compiler.codegen.activation import apply_activation
from cuvil.compiler.codegen.emitter import Emitter, View
from cuvil.compiler.codegen.gemm_kernel import PLAIN, Epilogue, emit_parallel_gemm
from cuvil.compiler.ir import Dim, Node, TensorType, Value
from cuvil.compiler.ops import UNCHECKED, InferContext, Op, broadcast_shapes, register
from cuvil.compiler.ops._window import compute_dtype, entry_alloca
from cuvil.errors import ModelError

FLOATS = ("float32", "float64", "float16")


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
#: activation of codegen/activation.py and its parameters, applied in the kernel's epilogue
FUSED_ACTIVATION = "cuvil.fused_activation"
ACTIVATION_PARAMS = "cuvil.activation_params"
#: input slot of a fused residual: a tensor of the output's type, added before the activation
RESIDUAL_SLOT = 3
#: MatMul's input slot for a fused bias (one value per output column, added first)
MATMUL_BIAS_SLOT = 2


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


def emit_kernel_matmul(k: Emitter, a: View, b: View, y: View, *, accumulate: bool = False,
                       bias: ir.Value | None = None, residual: ir.Value | None = None,
                       epilogue: Epilogue = PLAIN) -> None:
    """y = a @ b (+ y) (+ bias) (+ residual, laid out like y) on the shared, threaded GEMM
    kernel (`uses_kernel` holds)."""
    emit_parallel_gemm(k, a.dims[0], b.dims[1], a.dims[1], a.ptr, a.strides[0], b.ptr,
                       b.strides[0], y.ptr, y.strides[0], accumulate=accumulate, bias=bias,
                       residual=residual, epilogue=epilogue)


def _check_same_dtype(node: Node) -> None:
    dtypes = {v.type.dtype for v in node.inputs if v is not None}
    if len(dtypes) > 1:
        raise ModelError(f"{node.describe()}: inputs have different dtypes "
                         f"({', '.join(sorted(str(d) for d in dtypes))}); they must match")


def _transposed(v: View) -> View:
    return replace(v, dims=v.dims[::-1], strides=v.strides[::-1], shape=v.shape[::-1])


@register
class Gemm(Op):
    """Y = alpha * A' @ B' + beta * C, with A' and B' optionally transposed."""

    op_type = "Gemm"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _check_same_dtype(node)
        a, b = node.inputs[0], node.inputs[1]
        assert a is not None and b is not None
        if a.type.rank != 2 or b.type.rank != 2:
            raise ModelError(f"{node.describe()}: Gemm needs 2-D inputs, got {a.type} and {b.type}")
        m, ka = a.type.shape[::-1] if node.attrs.get("transA", 0) else a.type.shape
        kb, n = b.type.shape[::-1] if node.attrs.get("transB", 0) else b.type.shape
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
        a_val, b_val, c_val = node.inputs[0], node.inputs[1], node.input(2)
        assert a_val is not None and b_val is not None
        y_val = node.outputs[0]
        a, b, y = k.view(a_val), k.view(b_val), k.view(y_val)
        if node.attrs.get("transA", 0):
            a = _transposed(a)
        if node.attrs.get("transB", 0):
            b = _transposed(b)
        alpha = float(node.attrs.get("alpha", 1.0))
        beta = float(node.attrs.get("beta", 1.0))
        accumulate = c_val is not None and beta != 0.0
        epilogue, r_val = node_epilogue(node), node.input(RESIDUAL_SLOT)
        if alpha == 1.0 and uses_kernel(a, b, y):
            residual = k.buffers[r_val] if r_val is not None else None
            bias_kind = _bias_kind(c_val, y_val.type.shape) if accumulate and beta == 1.0 else None
            if bias_kind is not None:
                assert c_val is not None
                emit_kernel_matmul(k, a, b, y, bias=k.buffers[c_val], residual=residual,
                                   epilogue=replace(epilogue, bias=bias_kind))
                return
            if accumulate:
                _fill_scaled(k, c_val, y, y_val.type.shape, beta)
            emit_kernel_matmul(k, a, b, y, accumulate=accumulate, residual=residual,
                               epilogue=epilogue)
            return
        if compute_dtype(y.dtype) != y.dtype or prefers_dot(a, b):
            c = k.broadcast_to(k.view(c_val), y_val.type.shape) if accumulate else None
            emit_matmul_dot(k, a, b, y, alpha=alpha, c=c, beta=beta)
        else:
            if accumulate:
                _fill_scaled(k, c_val, y, y_val.type.shape, beta)
            emit_matmul(k, a, b, y, alpha=alpha, accumulate=accumulate)
        if epilogue != PLAIN:
            apply_epilogue(k, y, epilogue, k.view(r_val) if r_val is not None else None)


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
class MatMul(Op):
    """numpy.matmul semantics: 1-D operands are promoted, batch dims broadcast."""

    op_type = "MatMul"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _check_same_dtype(node)
        a, b = node.inputs[0], node.inputs[1]
        assert a is not None and b is not None
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
        a_val, b_val = node.inputs[0], node.inputs[1]
        assert a_val is not None and b_val is not None
        y_val = node.outputs[0]
        a, b, y = k.view(a_val), k.view(b_val), k.view(y_val)
        one = k.i64(1)
        zero = k.i64(0)
        # promote 1-D operands to matrices: [K] -> [1,K] for a, [K] -> [K,1] for b
        if a.rank == 1:
            a = replace(a, dims=(one, *a.dims), strides=(zero, *a.strides), shape=(1, *a.shape))
        if b.rank == 1:
            b = replace(b, dims=(*b.dims, one), strides=(*b.strides, zero), shape=(*b.shape, 1))
        batch_shape = broadcast_shapes(node, UNCHECKED, a.shape[:-2], b.shape[:-2])
        # y holds batch x M x N elements in that order whatever operands were promoted
        y_full = k.contiguous(y.ptr, y.dtype, (*batch_shape, a.shape[-2], b.shape[-1]))
        a_b = _broadcast_batch(k, a, batch_shape)
        b_b = _broadcast_batch(k, b, batch_shape)
        dot = compute_dtype(y.dtype) != y.dtype or prefers_dot(a, b)
        kernel = emit_matmul_dot if dot else emit_matmul
        bias_val, r_val = node.input(MATMUL_BIAS_SLOT), node.input(RESIDUAL_SLOT)
        epilogue = node_epilogue(node, "col" if bias_val is not None else "none")
        # a fused residual has y's shape, hence y_full's layout
        r_full = k.contiguous(k.buffers[r_val], y.dtype, y_full.shape) if r_val is not None else None
        batches = [k.dim(d) for d in batch_shape]
        if uses_kernel(a, b, y_full):
            bias = k.buffers[bias_val] if bias_val is not None else None
            with k.loops(batches, name="batch") as idx:
                emit_kernel_matmul(k, _at(k, a_b, idx), _at(k, b_b, idx), _at(k, y_full, idx),
                                   bias=bias, epilogue=epilogue,
                                   residual=_at(k, r_full, idx).ptr if r_full is not None else None)
            return
        with k.loops(batches, name="batch") as idx:
            kernel(k, _at(k, a_b, idx), _at(k, b_b, idx), _at(k, y_full, idx))
        if epilogue != PLAIN:
            apply_epilogue(k, y_full, epilogue, r_full,
                           k.view(bias_val) if bias_val is not None else None)


def _broadcast_batch(k: Emitter, v: View, batch: tuple[Dim, ...]) -> View:
    """Broadcast the batch dims of a [..., R, C] view to `batch`."""
    head = View(v.ptr, v.dtype, v.dims[:-2], v.strides[:-2], v.shape[:-2])
    hb = k.broadcast_to(head, batch)
    return replace(v, dims=(*hb.dims, *v.dims[-2:]), strides=(*hb.strides, *v.strides[-2:]),
                   shape=(*batch, *v.shape[-2:]))


def _at(k: Emitter, v: View, batch_index: list) -> View:
    """The 2-D matrix of `v` at a batch index."""
    if not batch_index:
        return v
    off = k.offset(replace(v, strides=v.strides[: len(batch_index)]), batch_index)
    return replace(v, ptr=k.element_ptr(v, off), dims=v.dims[-2:], strides=v.strides[-2:],
                   shape=v.shape[-2:])
