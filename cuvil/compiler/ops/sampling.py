"""Sampling at fractional positions: GridSample (opsets 16 and 20+) and RoiAlign (10, 16).

Both read an input at positions computed at run time (from a grid of normalized coordinates,
or from regions of interest) and interpolate between the neighbouring elements. The formulas
follow onnxruntime's step by step, in float32 (float64 when an input is float64): the same
pixel is picked for nearest, and interpolated values agree to rounding. Positions outside
the input never read outside it: every index is clamped or masked before the load.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Node, TensorType, numel, simplify_dim
from cuvil.compiler.kernels.emitter import I1, I64, Emitter, llvm_type
from cuvil.compiler.ops import FLOATS, InferContext, Op, attr, compute_dtype, register, required_input
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError, UnsupportedOpError

#: dtypes GridSample's nearest mode moves without arithmetic
_GATHERED = ("int8", "int16", "int32", "int64", "uint8", "bool")


class _Float:
    """Scalar float arithmetic of one compute dtype, with NaN-safe clamps and conversions."""

    def __init__(self, k: Emitter, dtype: np.dtype) -> None:
        self.k, self.b, self.dtype = k, k.b, np.dtype(dtype)
        self.ty = llvm_type(self.dtype)

    def c(self, v: float) -> ir.Value:
        return ir.Constant(self.ty, float(v))

    def of_int(self, v: ir.Value) -> ir.Value:
        return self.b.sitofp(v, self.ty)

    def to_int(self, v: ir.Value) -> ir.Value:
        """Truncation toward zero that saturates (and maps NaN to 0) instead of being poison."""
        fn = self.k.module.declare_intrinsic("llvm.fptosi.sat", [I64, self.ty],
                                             ir.FunctionType(I64, [self.ty]))
        return self.b.call(fn, [v])

    def clamp(self, v: ir.Value, lo: ir.Value, hi: ir.Value) -> ir.Value:
        """min(max(v, lo), hi); NaN becomes lo."""
        v = self.b.select(self.b.fcmp_ordered(">=", v, lo), v, lo)
        return self.b.select(self.b.fcmp_ordered("<=", v, hi), v, hi)

    def floor(self, v: ir.Value) -> ir.Value:
        return self.k.intrinsic("llvm.floor", [v])

    def reflect(self, v: ir.Value, lo: ir.Value, hi: ir.Value) -> ir.Value:
        """onnxruntime's GsReflect: fold v back into [lo, hi] by mirroring at the borders."""
        b = self.b
        span = b.fsub(hi, lo)
        below = b.fcmp_ordered("<", v, lo)
        above = b.fcmp_ordered(">", v, hi)
        dx = b.select(below, b.fsub(lo, v), b.fsub(v, hi))
        turns = self.k.intrinsic("llvm.trunc", [b.fdiv(dx, span)])
        rest = b.fsub(dx, b.fmul(turns, span))
        odd = b.fcmp_ordered("!=", b.frem(turns, self.c(2)), self.c(0))
        from_lo = b.xor(below, odd)  # below after an even number of turns, or above after odd
        folded = b.select(from_lo, b.fadd(lo, rest), b.fsub(hi, rest))
        outside = b.or_(below, above)
        # a single-element axis (span 0) has one place to go
        folded = b.select(b.fcmp_ordered("==", span, self.c(0)), lo, folded)
        return b.select(outside, folded, v)


def _cubic_coeffs(f: _Float, t: ir.Value) -> list[ir.Value]:
    """Keys' cubic convolution weights (a = -0.75) of the taps at -1, 0, 1, 2 from floor(x),
    where t = x - floor(x); written as onnxruntime writes them."""
    b = f.b
    a = -0.75
    t = f.k.intrinsic("llvm.fabs", [t])
    one, two = f.c(1), f.c(2)

    def outer(u: ir.Value) -> ir.Value:
        # ((a*u - 5a)*u + 8a)*u - 4a
        v = b.fsub(b.fmul(f.c(a), u), f.c(5 * a))
        v = b.fadd(b.fmul(v, u), f.c(8 * a))
        return b.fsub(b.fmul(v, u), f.c(4 * a))

    def inner(u: ir.Value) -> ir.Value:
        # ((a+2)*u - (a+3))*u*u + 1
        v = b.fsub(b.fmul(f.c(a + 2), u), f.c(a + 3))
        return b.fadd(b.fmul(b.fmul(v, u), u), one)

    return [outer(b.fadd(t, one)), inner(t), inner(b.fsub(one, t)), outer(b.fsub(two, t))]


# -- GridSample -------------------------------------------------------------------------------

_MODES_16 = {"bilinear": "linear", "nearest": "nearest", "bicubic": "cubic"}
_MODES_20 = {"linear": "linear", "nearest": "nearest", "cubic": "cubic"}
_PADDING = ("zeros", "border", "reflection")
_TAPS = {"nearest": 1, "linear": 2, "cubic": 4}
#: most taps (elements read per output) GridSample unrolls: cubic in 3-D
_MAX_TAPS = 64
#: grid points per task of the parallel loop
_BLOCK = 64


@register
class GridSample(Op):
    """Y[n, c, p...] interpolates X[n, c] at the position grid[n, p..., :] (normalized to
    [-1, 1], last spatial axis first). Opset 16 names the modes bilinear/nearest/bicubic and
    takes 4-D inputs; opset 20 renames them linear/nearest/cubic and takes any rank.

    Padding follows onnxruntime: "border" clamps each tap's index (not the coordinate, so
    cubic sees the border pixel repeated, as in PyTorch); "reflection" mirrors the coordinate
    at the borders (the pixel centres with align_corners, the pixel edges without) and then
    each tap's index; "zeros" reads 0 outside. Nearest rounds half to even.
    """

    op_type = "GridSample"
    since = 16
    dtypes = (*FLOATS, *_GATHERED)

    def _attrs(self, node: Node) -> tuple[str, str, bool]:
        names = _MODES_16 if node.opset < 20 else _MODES_20
        mode = str(attr(node, "mode"))
        if mode not in names:
            raise ModelError(f"{node.describe()}: mode {mode!r} is not one of {list(names)} "
                             f"(the names at opset {node.opset})")
        padding = str(attr(node, "padding_mode"))
        if padding not in _PADDING:
            raise ModelError(f"{node.describe()}: padding_mode {padding!r} is not one of "
                             f"{list(_PADDING)}")
        align = attr(node, "align_corners")
        if align not in (0, 1):
            raise ModelError(f"{node.describe()}: align_corners must be 0 or 1, got {align!r}")
        return names[mode], padding, bool(align)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x, grid = required_input(node, 0), required_input(node, 1)
        mode, _, _ = self._attrs(node)
        self.check_dtypes(node)
        dtype = x.type.dtype
        if dtype.name not in FLOATS and mode != "nearest":
            raise UnsupportedOpError(f"{node.describe()}: mode {mode!r} interpolates, which cuvil "
                                     f"compiles for {', '.join(FLOATS)} input only; X is "
                                     f"{dtype.name} (mode 'nearest' takes it)")
        if grid.type.dtype.name not in FLOATS:
            raise ModelError(f"{node.describe()}: grid must be {', '.join(FLOATS)}, got "
                             f"{grid.type.dtype.name}")
        rank = x.type.rank
        r = rank - 2
        if r < 1 or (node.opset < 20 and rank != 4):
            want = "4-D (N, C, H, W)" if node.opset < 20 else "(N, C, D1, ..., Dr) with r >= 1"
            raise ModelError(f"{node.describe()}: X must be {want} at opset {node.opset}, got "
                             f"{x.type}")
        if grid.type.rank != rank:
            raise ModelError(f"{node.describe()}: grid {grid.type} must have rank {rank} "
                             f"(N, {r} output dims, {r}) for X {x.type}")
        if _TAPS[mode] ** r > _MAX_TAPS:
            raise UnsupportedOpError(f"{node.describe()}: mode {mode!r} over {r} spatial dims "
                                     f"reads {_TAPS[mode] ** r} elements per output; cuvil "
                                     f"compiles at most {_MAX_TAPS}")
        ctx.dims_equal(node, grid.type.shape[-1], r, "grid's last dim (one coordinate per "
                       "spatial dim of X)")
        batch = ctx.dims_equal(node, x.type.shape[0], grid.type.shape[0], "batch of X and grid")
        return [TensorType(dtype, (batch, x.type.shape[1], *grid.type.shape[1:-1]))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, g_val = required_input(node, 0), required_input(node, 1)
        mode, _, _ = self._attrs(node)
        shape = x_val.type.shape
        r = len(shape) - 2
        if any(isinstance(d, int) and d == 0 for d in shape[2:]):
            # nothing to sample from: every position is outside
            raise UnsupportedOpError(f"{node.describe()}: X {x_val.type} has an empty spatial "
                                     "dim; there is nothing to sample")
        points = numel(g_val.type.shape[1:-1])
        total = k.dim(simplify_dim(shape[0] * points))
        # about 4 operations per tap and channel, and the coordinates' arithmetic
        cost = simplify_dim(shape[1] * _TAPS[mode] ** r * 4 + 40 * r)
        blocks = k.b.sdiv(k.b.add(total, k.i64(_BLOCK - 1)), k.i64(_BLOCK))
        with k.parallel_loop(blocks, cost=simplify_dim(cost * _BLOCK), name="pts") as blk:
            b = k.b
            start = b.mul(blk, k.i64(_BLOCK))
            stop = b.add(start, k.i64(_BLOCK))
            end = k.dim(simplify_dim(shape[0] * points))
            stop = b.select(b.icmp_signed("<", stop, end), stop, end)
            per_image = k.dim(points)
            with k.loop(stop, start=start, name="q") as q:
                n = b.udiv(q, per_image)
                self._point(node, k, n, b.sub(q, b.mul(n, per_image)))

    def _point(self, node: Node, k: Emitter, n: ir.Value, p: ir.Value) -> None:
        """Y[n, :, p]: the taps of grid point p of image n, then every channel."""
        x_val, g_val, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        mode, padding, align = self._attrs(node)
        dtype, gdtype = x_val.type.dtype, g_val.type.dtype
        shape = x_val.type.shape
        r = len(shape) - 2
        f = _Float(k, compute_dtype(dtype, gdtype))
        b = k.b
        points = numel(g_val.type.shape[1:-1])
        xv = k.view(x_val)
        gv = k.contiguous(k.buffers[g_val], gdtype, (shape[0], points, r))
        yv = k.contiguous(k.buffers[out], dtype, (shape[0], shape[1], points))
        lengths = [xv.dims[2 + a] for a in range(r)]
        strides = [xv.strides[2 + a] for a in range(r)]
        zero_i = k.i64(0)
        # per spatial axis: the taps' indices (with a validity flag for "zeros") and weights
        axis_taps: list[list[tuple[ir.Value, ir.Value | None, ir.Value | None]]] = []
        for a in range(r):
            length = f.of_int(lengths[a])
            last = b.fsub(length, f.c(1))
            lo, hi = (f.c(0), last) if align else (f.c(-0.5), b.fsub(length, f.c(0.5)))
            g = k.convert(k.load(gv, [n, p, k.i64(r - 1 - a)]), gdtype, f.dtype)
            if align:  # [-1, 1] -> [0, length - 1]
                pos = b.fmul(b.fdiv(b.fadd(g, f.c(1)), f.c(2)), last)
            else:  # [-1, 1] -> [-0.5, length - 0.5]
                pos = b.fdiv(b.fsub(b.fmul(b.fadd(g, f.c(1)), length), f.c(1)), f.c(2))
            if mode == "nearest":
                pos = k.intrinsic("llvm.roundeven", [pos])
            if padding == "reflection":
                pos = f.reflect(pos, lo, hi)

            def tap(at: ir.Value, length: ir.Value = length, last: ir.Value = last,
                    lo: ir.Value = lo, hi: ir.Value = hi) -> tuple[ir.Value, ir.Value | None]:
                """The element index of the tap at float position `at` (an integer value)."""
                if padding == "zeros":
                    inside = b.and_(b.fcmp_ordered(">=", at, f.c(0)),
                                    b.fcmp_ordered("<=", at, last))
                    return f.to_int(b.select(inside, at, f.c(0))), inside
                if padding == "reflection":
                    at = f.reflect(at, lo, hi)
                return f.to_int(f.clamp(at, f.c(0), last)), None

            if mode == "nearest":
                i, ok = tap(k.intrinsic("llvm.trunc", [pos]))
                axis_taps.append([(i, ok, None)])
                continue
            base = f.floor(pos)
            frac = b.fsub(pos, base)
            if mode == "linear":
                nxt = b.fadd(base, f.c(1))
                weights = [b.fsub(nxt, pos), frac]
                starts = [base, nxt]
            else:
                weights = _cubic_coeffs(f, frac)
                starts = [b.fadd(base, f.c(j - 1)) for j in range(4)]
            axis_taps.append([(*tap(s), w) for s, w in zip(starts, weights)])

        # offsets of every tap combination, computed once for all channels
        combos: dict[tuple[int, ...], tuple[ir.Value, ir.Value | None]] = {}

        def collect(a: int, key: tuple[int, ...], off: ir.Value, ok: ir.Value | None) -> None:
            if a == r:
                combos[key] = (off, ok)
                return
            for j, (i, valid, _) in enumerate(axis_taps[a]):
                both = valid if ok is None else (ok if valid is None else b.and_(ok, valid))
                collect(a + 1, (*key, j), b.add(off, b.mul(i, strides[a])), both)

        collect(0, (), zero_i, None)
        with k.loop(yv.dims[1], name="c") as c:
            origin = k.offset(xv, [n, c, *([zero_i] * r)])

            def value(key: tuple[int, ...]) -> ir.Value:
                off, ok = combos[key]
                v = k.load_at(xv, b.add(origin, off))
                if ok is not None:
                    v = b.select(ok, v, k.const(dtype, 0))
                return v if mode == "nearest" else k.convert(v, dtype, f.dtype)

            def interpolate(a: int, key: tuple[int, ...]) -> ir.Value:
                # the last spatial axis innermost, as onnxruntime nests its sums
                if a == r:
                    return value(key)
                acc: ir.Value | None = None
                for j, (_, _, w) in enumerate(axis_taps[a]):
                    v = interpolate(a + 1, (*key, j))
                    term = v if w is None else b.fmul(w, v)
                    acc = term if acc is None else b.fadd(acc, term)
                assert acc is not None
                return acc

            result = interpolate(0, ())
            if mode != "nearest":
                result = k.convert(result, f.dtype, dtype)
            k.store(yv, [n, c, p], result)


# -- RoiAlign ---------------------------------------------------------------------------------


@register
class RoiAlign(Op):
    """Mask R-CNN's RoI Align: each region of interest (x1, y1, x2, y2 in input coordinates
    times spatial_scale) is split into output_height x output_width bins; each bin averages
    (mode "avg") or takes the maximum (mode "max") of a regular grid of bilinear samples.

    As onnxruntime (and onnx's reference) do, mode "max" takes the maximum of the samples'
    weighted corner values (w1*v1, ..., w4*v4) rather than of interpolated values. Opset 10
    has no coordinate_transformation_mode and behaves as "output_half_pixel" (no half-pixel
    shift, regions at least 1x1); opset 16 defaults to "half_pixel". A batch index outside
    X fails the call.
    """

    op_type = "RoiAlign"
    since = 10
    dtypes = ("float32", "float64")

    def _attrs(self, node: Node) -> tuple[str, bool, int, int, int, float]:
        mode = str(attr(node, "mode"))
        if mode not in ("avg", "max"):
            raise ModelError(f"{node.describe()}: mode {mode!r} is not 'avg' or 'max'")
        if node.opset < 16:
            if "coordinate_transformation_mode" in node.attrs:
                raise ModelError(f"{node.describe()}: coordinate_transformation_mode exists from "
                                 f"opset 16 on; this model uses opset {node.opset}")
            ctm = "output_half_pixel"
        else:
            ctm = str(attr(node, "coordinate_transformation_mode"))
        if ctm not in ("half_pixel", "output_half_pixel"):
            raise ModelError(f"{node.describe()}: coordinate_transformation_mode {ctm!r} is not "
                             "'half_pixel' or 'output_half_pixel'")
        height = int(attr(node, "output_height"))
        width = int(attr(node, "output_width"))
        ratio = int(attr(node, "sampling_ratio"))
        if height < 1 or width < 1:
            raise ModelError(f"{node.describe()}: output_height and output_width must be >= 1, got "
                             f"{height} and {width}")
        if ratio < 0:
            raise ModelError(f"{node.describe()}: sampling_ratio must be >= 0 (0: adaptive), got "
                             f"{ratio}")
        return mode, ctm == "half_pixel", height, width, ratio, float(
            attr(node, "spatial_scale"))

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x, rois, idx = required_input(node, 0), required_input(node, 1), required_input(node, 2)
        _, _, height, width, _, _ = self._attrs(node)
        if x.type.rank != 4:
            raise ModelError(f"{node.describe()}: X must be 4-D (N, C, H, W), got {x.type}")
        if rois.type.rank != 2 or rois.type.dtype != x.type.dtype:
            raise ModelError(f"{node.describe()}: rois must be (num_rois, 4) of X's dtype "
                             f"{x.type.dtype.name}, got {rois.type}")
        if idx.type.rank != 1 or idx.type.dtype.name != "int64":
            raise ModelError(f"{node.describe()}: batch_indices must be (num_rois,) int64, got "
                             f"{idx.type}")
        ctx.dims_equal(node, rois.type.shape[1], 4, "rois columns (x1, y1, x2, y2)")
        count = ctx.dims_equal(node, rois.type.shape[0], idx.type.shape[0],
                               "rows of rois and batch_indices")
        return [TensorType(x.type.dtype, (count, x.type.shape[1], height, width))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, r_val, i_val = (required_input(node, i) for i in range(3))
        mode, half_pixel, height, width, ratio, scale = self._attrs(node)
        dtype = x_val.type.dtype
        f = _Float(k, dtype)
        b = k.b
        xv, rois, idx, yv = k.view(x_val), k.view(r_val), k.view(i_val), k.view(node.outputs[0])
        h_in, w_in = xv.dims[2], xv.dims[3]
        zero_i = k.i64(0)
        grid = [entry_alloca(k, I64, "grid_h"), entry_alloca(k, I64, "grid_w")]
        with k.loop(yv.dims[0], name="roi") as r:
            batch = k.load(idx, [r])
            k.fail_if(b.icmp_unsigned(">=", batch, xv.dims[0]))  # negative ones count as huge
            shift = f.c(0.5 if half_pixel else 0.0)
            corner = [b.fsub(b.fmul(k.load(rois, [r, k.i64(j)]), f.c(scale)), shift)
                      for j in range(4)]
            # per axis (y, x): start, bin size, samples per bin
            starts, bins = [corner[1], corner[0]], []
            for a, (lo, hi, pooled) in enumerate(((corner[1], corner[3], height),
                                                  (corner[0], corner[2], width))):
                extent = b.fsub(hi, lo)
                if not half_pixel:  # malformed regions become 1 x 1
                    extent = b.select(b.fcmp_ordered("<", extent, f.c(1)), f.c(1), extent)
                bins.append(b.fdiv(extent, f.c(pooled)))
                if ratio > 0:
                    b.store(k.i64(ratio), grid[a])
                else:
                    b.store(f.to_int(k.intrinsic("llvm.ceil", [b.fdiv(extent, f.c(pooled))])),
                            grid[a])
            gh, gw = b.load(grid[0]), b.load(grid[1])
            count = b.mul(gh, gw)
            count = b.select(b.icmp_signed("<", count, k.i64(1)), k.i64(1), count)
            with k.loop(height, name="ph") as ph, k.loop(width, name="pw") as pw:
                with k.loop(yv.dims[1], name="c0") as c:
                    k.store(yv, [r, c, ph, pw], f.c(0))
                with k.loop(gh, name="iy") as iy, k.loop(gw, name="ix") as ix:
                    taps = self._sample(k, f, [ph, pw], [iy, ix], starts, bins, [gh, gw],
                                        [h_in, w_in])
                    first = b.and_(b.icmp_signed("==", iy, zero_i), b.icmp_signed("==", ix, zero_i))
                    with k.loop(yv.dims[1], name="c") as c:
                        origin = k.offset(xv, [batch, c, zero_i, zero_i])
                        terms = [b.fmul(w, k.load_at(xv, b.add(origin, off))) for off, w in taps]
                        old = k.load(yv, [r, c, ph, pw])
                        if mode == "avg":
                            val = b.fadd(b.fadd(b.fadd(terms[0], terms[1]), terms[2]), terms[3])
                            new = b.fadd(old, val)
                        else:
                            val = k.fmax(k.fmax(k.fmax(terms[0], terms[1]), terms[2]), terms[3])
                            new = b.select(first, val, k.fmax(old, val))
                        k.store(yv, [r, c, ph, pw], new)
                if mode == "avg":
                    total = b.sitofp(count, f.ty)
                    with k.loop(yv.dims[1], name="c1") as c:
                        k.store(yv, [r, c, ph, pw], b.fdiv(k.load(yv, [r, c, ph, pw]), total))

    @staticmethod
    def _sample(k: Emitter, f: _Float, bin_index: Sequence[ir.Value], sample: Sequence[ir.Value],
                starts: Sequence[ir.Value], bins: Sequence[ir.Value], grid: Sequence[ir.Value],
                dims: Sequence[ir.Value]) -> list[tuple[ir.Value, ir.Value]]:
        """The four (offset in the H x W plane, weight) corners of one bilinear sample."""
        b = k.b
        pos, outside = [], ir.Constant(I1, 0)
        for a in range(2):
            # start + bin * size + (sample + 0.5) * size / grid
            p = b.fadd(starts[a], b.fmul(f.of_int(bin_index[a]), bins[a]))
            p = b.fadd(p, b.fdiv(b.fmul(b.fadd(f.of_int(sample[a]), f.c(0.5)), bins[a]),
                                 f.of_int(grid[a])))
            length = f.of_int(dims[a])
            outside = b.or_(outside, b.or_(b.fcmp_ordered("<", p, f.c(-1)),
                                           b.fcmp_ordered(">", p, length)))
            pos.append(p)
        lows, highs, fracs = [], [], []
        for a in range(2):
            p = b.select(b.fcmp_ordered("<=", pos[a], f.c(0)), f.c(0), pos[a])
            low = f.to_int(p)
            last = b.sub(dims[a], k.i64(1))
            at_end = b.icmp_signed(">=", low, last)
            low = b.select(at_end, last, low)
            high = b.select(at_end, last, b.add(low, k.i64(1)))
            p = b.select(at_end, f.of_int(low), p)
            lows.append(low)
            highs.append(high)
            fracs.append(b.fsub(p, f.of_int(low)))
        ly, lx = fracs
        hy, hx = b.fsub(f.c(1), ly), b.fsub(f.c(1), lx)
        corners = [(lows[0], lows[1], b.fmul(hy, hx)), (lows[0], highs[1], b.fmul(hy, lx)),
                   (highs[0], lows[1], b.fmul(ly, hx)), (highs[0], highs[1], b.fmul(ly, lx))]
        taps = []
        for row, col, w in corners:
            off = b.add(b.mul(row, dims[1]), col)
            # a sample outside the input reads element 0 with weight 0, as onnxruntime does
            taps.append((b.select(outside, k.i64(0), off), b.select(outside, f.c(0), w)))
        return taps
