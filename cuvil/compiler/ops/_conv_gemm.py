"""float32 convolution as matrix products on the shared GEMM kernel.

For each image and group, the output channels are Y[Mg, P] = W[Mg, Cg*K] @ X'[Cg*K, P], where
P counts output positions and X' ("im2col") lists, for every input channel and kernel tap,
the input value each output position reads (zero in the padding). X' is written into the
node's scratch memory; a 1x1 convolution with unit strides and no padding reads X directly.
The bias (and a fused ReLU) are applied by the kernel while the tile is in registers.
"""

from __future__ import annotations

from llvmlite import ir

from cuvil.compiler.codegen.emitter import Emitter, View
from cuvil.compiler.codegen.gemm_kernel import Epilogue, emit_parallel_gemm
from cuvil.compiler.ir import Dim, Node, numel
from cuvil.compiler.ops._window import Window, ceil_div, clamp

F32 = ir.FloatType()


def is_pointwise(win: Window) -> bool:
    return (all(k == 1 for k in win.kernel) and all(s == 1 for s in win.strides)
            and all(p == 0 for p in (*win.pads_begin, *win.pads_end)))


def im2col_bytes(node: Node, win: Window) -> Dim:
    """Scratch for one (image, group) slice of X'; none for pointwise convolutions."""
    if is_pointwise(win):
        return 0
    w = node.inputs[1]
    assert w is not None
    cg = int(w.type.shape[1])
    taps = 1
    for k in win.kernel:
        taps *= k
    return numel([cg * taps, *win.out, 4])


def lower_conv_gemm(node: Node, k: Emitter, win: Window, activation: str | None = None) -> None:
    x_val, w_val, b_val = node.inputs[0], node.inputs[1], node.input(2)
    assert x_val is not None and w_val is not None
    y_val = node.outputs[0]
    b = k.b
    group = int(node.attrs.get("group", 1))
    m, cg = int(w_val.type.shape[0]), int(w_val.type.shape[1])
    mg = m // group
    taps = 1
    for t in win.kernel:
        taps *= t
    kk = cg * taps
    c_in = x_val.type.shape[1]
    p = k.dim(numel(win.out))
    in_plane = k.dim(numel(x_val.type.shape[2:]))
    x_ptr, w_ptr, y_ptr = k.buffers[x_val], k.buffers[w_val], k.buffers[y_val]
    bias = k.buffers[b_val] if b_val is not None else None
    epilogue = Epilogue("row" if bias is not None else "none", relu=activation == "Relu")
    pointwise = is_pointwise(win)
    with k.loop(k.dim(x_val.type.shape[0]), name="n") as n, k.loop(group, name="g") as g:
        first_channel = b.add(b.mul(n, k.dim(c_in)), b.mul(g, k.i64(cg)))
        x_slice = b.gep(x_ptr, [b.mul(first_channel, in_plane)], source_etype=F32)
        if pointwise:
            cols = x_slice
        else:
            assert k.scratch is not None
            cols = k.scratch
            _im2col(k, x_slice, x_val.type.shape[2:], win, cols, cg)
        w_g = b.gep(w_ptr, [b.mul(g, k.i64(mg * kk))], source_etype=F32)
        y_g = b.gep(y_ptr, [b.mul(b.add(b.mul(n, k.i64(m)), b.mul(g, k.i64(mg))), p)],
                    source_etype=F32)
        bias_g = b.gep(bias, [b.mul(g, k.i64(mg))], source_etype=F32) if bias is not None else None
        emit_parallel_gemm(k, k.i64(mg), p, k.i64(kk), w_g, k.i64(kk), cols, p, y_g, p,
                           bias=bias_g, epilogue=epilogue)


def _im2col(k: Emitter, x: ir.Value, in_shape: tuple[Dim, ...], win: Window, cols: ir.Value,
            channels: int) -> None:
    """cols[(c, taps...), (o...)] = x[c, o*s + tap*d - pad] (0 outside the input)."""
    b = k.b
    r = len(win.kernel)
    xv = k.contiguous(x, "float32", (channels, *in_shape))
    cv = k.contiguous(cols, "float32", (channels, *win.kernel, *win.out))
    zero = ir.Constant(F32, 0.0)
    with k.loop(channels, name="c") as c, k.loops(win.kernel, name="tap") as tap:

        def nest(axis: int, out_idx: list[ir.Value], in_idx: list[ir.Value]) -> None:
            s = win.strides[axis]
            start = b.sub(b.mul(tap[axis], k.i64(win.dilations[axis])), k.dim(win.pads_begin[axis]))
            size = xv.dims[1 + axis]
            out = cv.dims[1 + r + axis]
            if axis < r - 1:
                with k.loop(out, name=f"o{axis}") as o:
                    i = b.add(b.mul(o, k.i64(s)), start)
                    inside = b.and_(b.icmp_signed(">=", i, k.i64(0)), b.icmp_signed("<", i, size))
                    with b.if_else(inside) as (then, otherwise):
                        with then:
                            nest(axis + 1, [*out_idx, o], [*in_idx, i])
                        with otherwise:
                            _fill_row(k, cv, [c, *tap, *out_idx, o], axis + 1, zero)
                return
            # innermost: zeros, the in-bounds run (a strided copy that vectorizes), zeros
            lo = clamp(k, ceil_div(k, b.neg(start), s), k.i64(0), out)
            hi = clamp(k, ceil_div(k, b.sub(size, start), s), lo, out)
            row = [c, *tap, *out_idx]
            with k.loop(lo, name="z0") as o:
                k.store(cv, [*row, o], zero)
            with k.loop(hi, start=lo, name="cp") as o:
                i = b.add(b.mul(o, k.i64(s)), start)
                k.store(cv, [*row, o], k.load(xv, [c, *in_idx, i]))
            with k.loop(out, start=hi, name="z1") as o:
                k.store(cv, [*row, o], zero)

        nest(0, [], [])


def _fill_row(k: Emitter, view: View, prefix: list[ir.Value], axis: int, value: ir.Value) -> None:
    """view[prefix..., :, :, ...] = value over the output axes from `axis` on."""
    r = (view.rank - 1) // 2
    with k.loops(view.dims[1 + r + axis:], name="zf") as rest:
        k.store(view, [*prefix, *rest], value)
