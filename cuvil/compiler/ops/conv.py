"""Convolution over 1, 2 or 3 spatial dims, with padding, strides, dilations and groups."""

from __future__ import annotations

from collections.abc import Sequence

from llvmlite import ir

from cuvil.compiler.codegen.emitter import Emitter, View
from cuvil.compiler.ir import Node, TensorType
from cuvil.compiler.ops import UNCHECKED, InferContext, Op, register
from cuvil.compiler.ops._window import Window, window
from cuvil.errors import ModelError


def conv_window(node: Node, ctx: InferContext) -> Window:
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None and w is not None
    kernel = node.attrs.get("kernel_shape", w.type.shape[2:])
    if not all(isinstance(d, int) for d in kernel):
        raise ModelError(f"{node.describe()}: the kernel shape must be static, got {kernel}")
    return window(node, ctx, x.type.shape[2:], kernel)


@register
class Conv(Op):
    op_type = "Conv"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x, w = node.inputs[0], node.inputs[1]
        assert x is not None and w is not None
        if x.type.rank < 3 or w.type.rank != x.type.rank:
            raise ModelError(
                f"{node.describe()}: input {x.type} and weight {w.type} must be N x C x spatial..."
            )
        group = int(node.attrs.get("group", 1))
        c_in, m = x.type.shape[1], w.type.shape[0]
        if not isinstance(m, int) or not isinstance(w.type.shape[1], int):
            raise ModelError(f"{node.describe()}: the weight shape must be static, got {w.type}")
        if m % group:
            raise ModelError(f"{node.describe()}: {m} output channels do not split into {group} groups")
        ctx.dims_equal(node, c_in, w.type.shape[1] * group, "input channels vs weight channels x group")
        b = node.input(2)
        if b is not None and tuple(b.type.shape) != (m,):
            raise ModelError(f"{node.describe()}: bias shape {b.type} should be [{m}]")
        win = conv_window(node, ctx)
        return [TensorType(x.type.dtype, (x.type.shape[0], m, *win.out))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, w_val, b_val = node.inputs[0], node.inputs[1], node.input(2)
        assert x_val is not None and w_val is not None
        y_val = node.outputs[0]
        win = conv_window(node, UNCHECKED)
        x, w, y = k.view(x_val), k.view(w_val), k.view(y_val)
        group = int(node.attrs.get("group", 1))
        m = int(w_val.type.shape[0])
        cg = int(w_val.type.shape[1])
        mg = m // group
        zero = k.const(y.dtype, 0.0)
        with k.loop(y.dims[0], name="n") as n, k.loop(m, name="m") as oc:
            g = k.b.sdiv(oc, k.i64(mg))
            bias = k.load(k.view(b_val), [oc]) if b_val is not None else zero
            with k.loops(y.dims[2:], name="o") as o:
                k.store(y, [n, oc, *o], bias)
            with k.loop(cg, name="c") as c:
                ic = k.b.add(k.b.mul(g, k.i64(cg)), c)
                with k.loops(win.kernel, name="kpos") as kpos:
                    wv = k.load(w, [oc, c, *kpos])
                    _accumulate_rows(k, x, y, n, oc, ic, kpos, wv, win)


def _accumulate_rows(k: Emitter, x: View, y: View, n: ir.Value, oc: ir.Value, ic: ir.Value,
                     kpos: Sequence[ir.Value], wv: ir.Value, win: Window) -> None:
    """y[n, oc, o...] += wv * x[n, ic, o*s + kpos*d - pad] for every in-bounds output position.

    Outer spatial dims are checked per position; the innermost one gets a computed valid range
    so its loop has no branch and vectorizes.
    """
    r = len(win.kernel)
    b = k.b

    def source(axis: int, o: ir.Value) -> ir.Value:
        start = b.sub(b.mul(kpos[axis], k.i64(win.dilations[axis])), k.dim(win.pads_begin[axis]))
        return b.add(b.mul(o, k.i64(win.strides[axis])), start)

    def nest(axis: int, out_idx: list[ir.Value], in_idx: list[ir.Value]) -> None:
        if axis == r - 1:
            s = win.strides[axis]
            start = b.sub(b.mul(kpos[axis], k.i64(win.dilations[axis])), k.dim(win.pads_begin[axis]))
            size = x.dims[2 + axis]
            # valid o: 0 <= o*s + start < size  ->  ceil(-start/s) <= o < ceil((size-start)/s)
            lo = _ceil_div(k, b.neg(start), s)
            hi = _ceil_div(k, b.sub(size, start), s)
            lo = _clamp(k, lo, k.i64(0), y.dims[2 + axis])
            hi = _clamp(k, hi, lo, y.dims[2 + axis])
            with k.loop(hi, start=lo, name="ow") as o:
                i = b.add(b.mul(o, k.i64(s)), start)
                xv = k.load(x, [n, ic, *in_idx, i])
                idx = [n, oc, *out_idx, o]
                k.store(y, idx, k.fmul_add(wv, xv, k.load(y, idx)))
            return
        with k.loop(y.dims[2 + axis], name=f"o{axis}") as o:
            i = source(axis, o)
            inside = b.and_(b.icmp_signed(">=", i, k.i64(0)),
                            b.icmp_signed("<", i, x.dims[2 + axis]))
            with k.if_then(inside):
                nest(axis + 1, [*out_idx, o], [*in_idx, i])

    nest(0, [], [])


def _ceil_div(k: Emitter, a: ir.Value, s: int) -> ir.Value:
    """ceil(a / s) for a positive constant s and any sign of a."""
    return k.b.neg(k.floordiv(k.b.neg(a), k.i64(s)))


def _clamp(k: Emitter, v: ir.Value, lo: ir.Value, hi: ir.Value) -> ir.Value:
    b = k.b
    v = b.select(b.icmp_signed("<", v, lo), lo, v)
    return b.select(b.icmp_signed(">", v, hi), hi, v)
