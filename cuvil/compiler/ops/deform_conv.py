"""DeformConv (opsets 19 and 22): a convolution whose kernel taps are moved, at each output
position, by offsets the model computes, and optionally scaled by a mask (deformable
convolution v1 and v2, as detection models use it).

For each image and group the sampled input is gathered into a column buffer in scratch memory,
the way im2col does for Conv: row (c, kh, kw), column (oh, ow) holds

    mask * bilinear(X[n, c], oh*sh - ph + kh*dh + dy, ow*sw - pw + kw*dw + dx)

where (dy, dx) is the offset of tap (kh, kw) in the offset group of channel c. Bilinear
corners outside the input read 0, and a position one pixel or more outside reads 0 altogether,
as onnxruntime (and torchvision) sample. Outside corners are skipped, not weighted by 0, so an
inf or NaN in X reaches only the outputs that sample it (as in onnx's reference; onnxruntime
lets it spread further). The output is then W_g @ columns: on the shared GEMM kernel for
float32, row by row for float64 and float16 (float16 is sampled and summed in float32 and
rounded once). The columns are built on the thread pool: a task finds the sampling points of
one tap and offset group for a block of positions once, and interpolates every channel they
serve.

Only 2-D convolutions (4-D X) are compiled: that is the case detection models use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, numel, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter, llvm_type
from cuvil.compiler.kernels.gemm import Epilogue, emit_parallel_gemm
from cuvil.compiler.ops import (
    FLOATS,
    UNCHECKED,
    InferContext,
    Op,
    attr,
    compute_dtype,
    register,
    required_input,
)
from cuvil.compiler.ops._window import Window
from cuvil.compiler.ops.conv import conv_window
from cuvil.errors import ModelError, UnsupportedOpError

F32 = ir.FloatType()


@dataclass(frozen=True)
class _Geometry:
    win: Window
    group: int
    offset_group: int
    channels: int  # input channels
    cg: int  # input channels per group
    m: int  # output channels
    mg: int  # output channels per group

    @property
    def taps(self) -> int:
        return self.win.kernel[0] * self.win.kernel[1]

    @property
    def rows(self) -> int:
        """Rows of one group's column buffer: (channel, kh, kw)."""
        return self.cg * self.taps


def _geometry(node: Node, ctx: InferContext) -> _Geometry:
    x, w, off = required_input(node, 0), required_input(node, 1), required_input(node, 2)
    bias, mask = node.input(3), node.input(4)
    if x.type.rank != 4:
        if x.type.rank >= 3:
            raise UnsupportedOpError(
                f"{node.describe()}: X {x.type} has {x.type.rank - 2} spatial dims; cuvil compiles "
                "2-D DeformConv only (X of shape N x C x H x W)")
        raise ModelError(f"{node.describe()}: X {x.type} must be N x C x spatial dims")
    for v, what in ((w, "W"), (off, "offset"), (bias, "B"), (mask, "mask")):
        if v is not None and v.type.dtype != x.type.dtype:
            raise ModelError(f"{node.describe()}: {what} has dtype {v.type.dtype.name}, X has "
                             f"{x.type.dtype.name}; they must be the same")
    if w.type.rank != 4 or not all(isinstance(d, int) for d in w.type.shape):
        raise ModelError(f"{node.describe()}: W {w.type} must be a static M x C/group x kH x kW")
    group = int(attr(node, "group"))
    offset_group = int(attr(node, "offset_group"))
    if group < 1 or offset_group < 1:
        raise ModelError(f"{node.describe()}: group ({group}) and offset_group ({offset_group}) "
                         "must be >= 1")
    m, cg = int(w.type.shape[0]), int(w.type.shape[1])
    if m % group:
        raise ModelError(f"{node.describe()}: {m} output channels do not split into {group} groups")
    channels = cg * group
    ctx.dims_equal(node, x.type.shape[1], channels, "input channels vs weight channels x group")
    if channels % offset_group:
        raise ModelError(f"{node.describe()}: {channels} input channels do not split into "
                         f"offset_group = {offset_group} groups")
    win = conv_window(node, ctx)
    taps = win.kernel[0] * win.kernel[1]
    batch = x.type.shape[0]
    for v, what, per_group in ((off, "offset", 2 * taps), (mask, "mask", taps)):
        if v is None:
            continue
        want = (batch, offset_group * per_group, *win.out)
        if v.type.rank != 4:
            raise ModelError(f"{node.describe()}: {what} {v.type} must have rank 4: "
                             f"{[str(d) for d in want]}")
        names = ("batch", "channels", "output height", "output width")
        for axis in range(4):
            ctx.dims_equal(node, v.type.shape[axis], want[axis],
                           f"{what} dim {axis} ({names[axis]}; offset_group x "
                           f"{'2 x ' if what == 'offset' else ''}kH x kW channels)")
    if bias is not None and tuple(bias.type.shape) != (m,):
        raise ModelError(f"{node.describe()}: B {bias.type} should have shape [{m}]")
    return _Geometry(win, group, offset_group, channels, cg, m, m // group)


@register
class DeformConv(Op):
    op_type = "DeformConv"
    since = 19
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        geo = _geometry(node, ctx)
        x = required_input(node, 0)
        return [TensorType(x.type.dtype, (x.type.shape[0], geo.m, *geo.win.out))]

    def scratch_bytes(self, node: Node) -> Dim:
        geo = _geometry(node, UNCHECKED)
        dtype = node.outputs[0].type.dtype
        ct = compute_dtype(dtype)
        cols = numel([geo.rows, *geo.win.out, ct.itemsize])
        if dtype != ct:  # float16: the sums of one group's outputs in float32
            cols = simplify_dim(cols + numel([geo.mg, *geo.win.out, ct.itemsize]))
        return cols

    def lower(self, node: Node, k: Emitter) -> None:
        geo = _geometry(node, UNCHECKED)
        dtype = node.outputs[0].type.dtype
        batch = required_input(node, 0).type.shape[0]
        with k.loop(batch, name="n") as n, k.loop(geo.group, name="g") as g:
            _columns(node, k, geo, n, g)
            if dtype.name != "float32":
                _product_rows(node, k, geo, n, g)
            else:
                _product_gemm(node, k, geo, n, g)


def _product_gemm(node: Node, k: Emitter, geo: _Geometry, n: ir.Value, g: ir.Value) -> None:
    """Y[n, group g] = B + W_g @ columns on the shared (threaded) GEMM kernel."""
    w_val, b_val, y_val = required_input(node, 1), node.input(3), node.outputs[0]
    assert k.scratch is not None
    b = k.b
    pv = k.dim(numel(geo.win.out))
    w_g = b.gep(k.buffers[w_val], [b.mul(g, k.i64(geo.mg * geo.rows))], source_etype=F32)
    first = b.add(b.mul(n, k.i64(geo.m)), b.mul(g, k.i64(geo.mg)))
    y_g = b.gep(k.buffers[y_val], [b.mul(first, pv)], source_etype=F32)
    bias = None
    if b_val is not None:
        bias = b.gep(k.buffers[b_val], [b.mul(g, k.i64(geo.mg))], source_etype=F32)
    emit_parallel_gemm(k, k.i64(geo.mg), pv, k.i64(geo.rows), w_g, k.i64(geo.rows), k.scratch, pv,
                       y_g, pv, bias=bias, epilogue=Epilogue("row" if bias is not None else "none"))


#: output positions per task of the column build
_BLOCK = 128


def _columns(node: Node, k: Emitter, geo: _Geometry, n: ir.Value, g: ir.Value) -> None:
    """scratch[(c, kh, kw), p] = mask * X[n, g*cg + c] sampled at tap (kh, kw) moved by the
    offset of output position p.

    The sampling point depends on the tap, the position and the offset group, not on the
    channel: each task takes one tap, one offset group and a block of positions, finds every
    position's four corners and weights once, then interpolates each channel of the group
    (and of the offset group) from them.
    """
    x_val, off_val, mask_val = required_input(node, 0), required_input(node, 2), node.input(4)
    dtype = x_val.type.dtype
    ct = compute_dtype(dtype)
    fty = llvm_type(ct)
    win = geo.win
    per_offset_group = geo.channels // geo.offset_group
    p = numel(win.out)
    blocks = simplify_dim(sympy.floor((sympy.sympify(p) + _BLOCK - 1) / _BLOCK))
    # per position: ~40 operations for the corners, ~12 per channel to interpolate
    cost = _BLOCK * (40 + 12 * min(geo.cg, per_offset_group))
    assert k.scratch is not None
    tasks = simplify_dim(blocks * geo.taps * geo.offset_group)
    with k.parallel_loop(tasks, cost=cost, name="cols", carry=[n, g, k.scratch]) as t:
        n_, g_, scratch = k.carried
        b = k.b
        zero = k.i64(0)
        x, off = k.view(x_val), k.view(off_val)
        mask = k.view(mask_val) if mask_val is not None else None
        pv, nblocks = k.dim(p), k.dim(blocks)
        block = b.srem(t, nblocks)
        rest = b.sdiv(t, nblocks)
        tap, og = b.srem(rest, k.i64(geo.taps)), b.sdiv(rest, k.i64(geo.taps))
        # the channels of group g in offset group og
        group_lo = b.mul(g_, k.i64(geo.cg))
        c_lo = _imax(k, b.mul(og, k.i64(per_offset_group)), group_lo)
        c_hi = _imin(k, b.mul(b.add(og, k.i64(1)), k.i64(per_offset_group)),
                     b.add(group_lo, k.i64(geo.cg)))
        with k.if_then(b.icmp_signed("<", c_lo, c_hi)):
            p0 = b.mul(block, k.i64(_BLOCK))
            p1 = _imin(k, b.add(p0, k.i64(_BLOCK)), pv)
            # per corner: element offset (0 when outside), all-ones bits when inside else 0
            # (an AND keeps the read value or zeroes it, whatever it holds), weight
            ity = ir.IntType(ct.itemsize * 8)
            corners = [(_entry_array(k, I64, f"at{i}"), I64) for i in range(4)]
            keeps = [(_entry_array(k, ity, f"keep{i}"), ity) for i in range(4)]
            weights = [(_entry_array(k, fty, f"w{i}"), fty) for i in range(4)]
            scale = (_entry_array(k, fty, "mask"), fty)

            def slot(array: tuple[ir.Value, ir.Type], j: ir.Value) -> ir.Value:
                return b.gep(array[0], [j], inbounds=True, source_etype=array[1])

            flat_off = k.contiguous(off.ptr, dtype, (off.shape[0], off.shape[1], p))
            ch_y = b.add(b.mul(og, k.i64(2 * geo.taps)), b.mul(tap, k.i64(2)))
            ch_x = b.add(ch_y, k.i64(1))
            kh, kw = b.sdiv(tap, k.i64(win.kernel[1])), b.srem(tap, k.i64(win.kernel[1]))
            start_y = b.sub(b.mul(kh, k.i64(win.dilations[0])), k.dim(win.pads_begin[0]))
            start_x = b.sub(b.mul(kw, k.i64(win.dilations[1])), k.dim(win.pads_begin[1]))
            out_w = k.dim(win.out[1])
            with k.loop(p1, start=p0, name="q") as q:
                j = b.sub(q, p0)
                oh, ow = b.sdiv(q, out_w), b.srem(q, out_w)
                base_y = b.sitofp(b.add(b.mul(oh, k.i64(win.strides[0])), start_y), fty)
                base_x = b.sitofp(b.add(b.mul(ow, k.i64(win.strides[1])), start_x), fty)
                dy = k.convert(k.load(flat_off, [n_, ch_y, q]), dtype, ct)
                dx = k.convert(k.load(flat_off, [n_, ch_x, q]), dtype, ct)
                taps = _corners(k, b.fadd(base_y, dy), b.fadd(base_x, dx), x.dims[2], x.dims[3], ct)
                for i, (at, ok, w) in enumerate(taps):
                    b.store(b.select(ok, at, zero), slot(corners[i], j))
                    b.store(b.sext(ok, ity), slot(keeps[i], j))
                    b.store(w, slot(weights[i], j))
                m = ir.Constant(fty, 1.0)
                if mask is not None:
                    flat_mask = k.contiguous(mask.ptr, dtype, (mask.shape[0], mask.shape[1], p))
                    ch_m = b.add(b.mul(og, k.i64(geo.taps)), tap)
                    m = k.convert(k.load(flat_mask, [n_, ch_m, q]), dtype, ct)
                b.store(m, slot(scale, j))
            cols = k.contiguous(scratch, ct, (geo.rows, p))
            with k.loop(c_hi, start=c_lo, name="c") as c:
                origin = k.offset(x, [n_, c, zero, zero])
                row = b.add(b.mul(b.sub(c, group_lo), k.i64(geo.taps)), tap)
                with k.loop(p1, start=p0, name="q1") as q:
                    j = b.sub(q, p0)
                    acc: ir.Value | None = None
                    for i in range(4):
                        at = b.load(slot(corners[i], j), typ=I64)
                        v = k.convert(k.load_at(x, b.add(origin, at)), dtype, ct)
                        v = b.bitcast(b.and_(b.bitcast(v, ity), b.load(slot(keeps[i], j), typ=ity)),
                                      fty)
                        term = b.fmul(b.load(slot(weights[i], j), typ=fty), v)
                        acc = term if acc is None else b.fadd(acc, term)
                    assert acc is not None
                    if mask is not None:
                        acc = b.fmul(acc, b.load(slot(scale, j), typ=fty))
                    k.store(cols, [row, q], acc)


def _entry_array(k: Emitter, ty: ir.Type, name: str) -> ir.Value:
    """_BLOCK elements of `ty` on the stack, allocated once in the entry block."""
    with k.b.goto_block(k.function.entry_basic_block):
        return k.b.alloca(ty, size=k.i64(_BLOCK), name=name)


def _imin(k: Emitter, a: ir.Value, c: ir.Value) -> ir.Value:
    return k.b.select(k.b.icmp_signed("<", a, c), a, c)


def _imax(k: Emitter, a: ir.Value, c: ir.Value) -> ir.Value:
    return k.b.select(k.b.icmp_signed(">", a, c), a, c)


def _corners(k: Emitter, py: ir.Value, px: ir.Value, height: ir.Value, width: ir.Value,
             ct: np.dtype) -> list[tuple[ir.Value, ir.Value, ir.Value]]:
    """The four bilinear corners of (py, px) in an H x W plane, as (element offset, inside,
    weight), in the order onnxruntime sums them. A point at -1 or beyond, or at the size or
    beyond (or NaN), has all four outside."""
    b = k.b
    fty = llvm_type(ct)

    def c(v: float) -> ir.Value:
        return ir.Constant(fty, v)

    def to_int(v: ir.Value) -> ir.Value:
        # saturating, NaN -> 0: never poison, whatever the offsets hold
        fn = k.module.declare_intrinsic("llvm.fptosi.sat", [I64, fty], ir.FunctionType(I64, [fty]))
        return b.call(fn, [v])

    inside = b.and_(
        b.and_(b.fcmp_ordered(">", py, c(-1.0)), b.fcmp_ordered("<", py, b.sitofp(height, fty))),
        b.and_(b.fcmp_ordered(">", px, c(-1.0)), b.fcmp_ordered("<", px, b.sitofp(width, fty))))
    fy, fx = k.intrinsic("llvm.floor", [py]), k.intrinsic("llvm.floor", [px])
    ly, lx = b.fsub(py, fy), b.fsub(px, fx)
    hy, hx = b.fsub(c(1.0), ly), b.fsub(c(1.0), lx)
    y0, x0 = to_int(fy), to_int(fx)
    y1, x1 = b.add(y0, k.i64(1)), b.add(x0, k.i64(1))
    zero = k.i64(0)
    ok_y = (b.icmp_signed(">=", y0, zero), b.icmp_signed("<", y1, height))
    ok_x = (b.icmp_signed(">=", x0, zero), b.icmp_signed("<", x1, width))
    out = []
    for (yy, oky, wy) in ((y0, ok_y[0], hy), (y1, ok_y[1], ly)):
        for (xx, okx, wx) in ((x0, ok_x[0], hx), (x1, ok_x[1], lx)):
            ok = b.and_(inside, b.and_(oky, okx))
            out.append((b.add(b.mul(yy, width), xx), ok, b.fmul(wy, wx)))
    return out


def _product_rows(node: Node, k: Emitter, geo: _Geometry, n: ir.Value, g: ir.Value) -> None:
    """Y[n, g*mg + j] = B + W[g*mg + j] @ columns, one output channel per task (float64 sums in
    Y itself, float16 in float32 scratch after the columns)."""
    w_val, b_val, y_val = required_input(node, 1), node.input(3), node.outputs[0]
    dtype = y_val.type.dtype
    ct = compute_dtype(dtype)
    p = numel(geo.win.out)
    assert k.scratch is not None
    with k.parallel_loop(geo.mg, cost=simplify_dim(p * geo.rows), name="rows",
                         carry=[n, g, k.scratch]) as j:
        n_, g_, scratch = k.carried
        b = k.b
        pv = k.dim(p)
        cols = k.contiguous(scratch, ct, (geo.rows, p))
        w = k.contiguous(k.buffers[w_val], dtype, (geo.m, geo.rows))
        y = k.contiguous(k.buffers[y_val], dtype, (y_val.type.shape[0], geo.m, p))
        oc = b.add(b.mul(g_, k.i64(geo.mg)), j)
        # the sums: Y's row itself, or (float16) row j of float32 scratch after the columns
        if dtype == ct:
            acc, at = k.contiguous(y.ptr, ct, (y_val.type.shape[0] * geo.m, p)), \
                b.add(b.mul(n_, k.i64(geo.m)), oc)
        else:
            sums = b.gep(scratch, [b.mul(k.i64(geo.rows), pv)], source_etype=llvm_type(ct))
            acc, at = k.contiguous(sums, ct, (geo.mg, p)), j
        init = k.const(ct, 0.0)
        if b_val is not None:
            init = k.convert(k.load(k.view(b_val), [oc]), dtype, ct)
        with k.loop(pv, name="q0") as q:
            k.store(acc, [at, q], init)
        with k.loop(geo.rows, name="r") as r:
            wv = k.convert(k.load(w, [oc, r]), dtype, ct)
            with k.loop(pv, name="q") as q:
                k.store(acc, [at, q], k.fmul_add(wv, k.load(cols, [r, q]), k.load(acc, [at, q])))
        if dtype != ct:
            with k.loop(pv, name="q1") as q:
                k.store(y, [n_, oc, q], k.convert(k.load(acc, [at, q]), ct, dtype))
