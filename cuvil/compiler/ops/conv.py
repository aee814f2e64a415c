"""Convolution and transposed convolution over any number of spatial dims, with padding
(explicit or auto_pad), strides, dilations and groups.

float32 convolutions run as matrix products on the shared GEMM kernel: 3x3 ones with unit
strides and enough channels as Winograd convolutions (`_conv_winograd`, which says which),
the others through im2col (`_conv_gemm`); depthwise ones (one input channel per group,
`uses_direct_depthwise`), which would be products of one or two rows, run on their own kernel
(`_conv_depthwise`). float32 transposed convolutions run as products of the transposed weights
and the input, scattered into the output (`_conv_transpose`).
float64 accumulates each kernel tap into the output in place, one row at a time:
the innermost spatial loop has a computed valid range, so it has no branch and vectorizes.
float16 is computed per output element in a float32 register (accumulating in float16
memory would round after every tap) and rounded once.

Col2Im (the inverse of im2col) gathers, for each image element, the column entries that
land on it, the way the float16 transposed convolution does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value, numel, simplify_dim
from cuvil.compiler.kernels.emitter import Emitter, View
from cuvil.compiler.ops import (
    FLOATS,
    UNCHECKED,
    InferContext,
    Op,
    attr,
    compute_dtype,
    const_input,
    const_or_symbolic_input,
    register,
    required_input,
)
from cuvil.compiler.ops._conv_depthwise import (
    depthwise_scratch_bytes,
    lower_conv_depthwise,
    uses_direct_depthwise,
)
from cuvil.compiler.ops._conv_gemm import (
    F32_DTYPE,
    TRANSPOSED,
    derive_float32_panels,
    im2col_bytes,
    lower_conv_gemm,
    transposed_product,
)
from cuvil.compiler.ops._conv_transpose import lower_conv_transpose_gemm
from cuvil.compiler.ops._conv_transpose import scratch_bytes as conv_transpose_scratch
from cuvil.compiler.ops._conv_winograd import (
    U_STORED,
    WINOGRAD_TILE,
    bf16_weight_transform,
    derive_float32_u,
    lower_conv_winograd,
    lower_weight_transform,
    runs_in_bf16,
    stored_weight_transform,
    weight_bytes,
    winograd_tile,
)
from cuvil.compiler.ops._conv_winograd import scratch_bytes as winograd_bytes
from cuvil.compiler.ops._window import (
    TransposedWindow,
    Window,
    auto_pad_of,
    ceil_div,
    clamp,
    entry_alloca,
    kernel_range,
    window,
)
from cuvil.compiler.ops.gemm import (
    BF16_WEIGHTS,
    FUSED_ACTIVATION,
    RESIDUAL_SLOT,
    check_fused_inputs,
    logical_weight,
)
from cuvil.errors import ModelError, UnsupportedOpError


def _kernel(node: Node, w: Value) -> tuple[int, ...]:
    """The kernel's spatial shape: from the weight, checked against kernel_shape if given."""
    shape = tuple(w.type.shape[2:])
    if not all(isinstance(d, int) for d in shape):
        raise ModelError(f"{node.describe()}: the weight shape must be static, got {w.type}")
    if "kernel_shape" in node.attrs and tuple(node.attrs["kernel_shape"]) != shape:
        raise ModelError(
            f"{node.describe()}: kernel_shape {list(node.attrs['kernel_shape'])} does not match "
            f"the weight's spatial shape {list(shape)}"
        )
    return shape


def _check_operands(node: Node, op: Op) -> tuple[Value, Value, int]:
    op.check_dtypes(node)
    x, w = required_input(node, 0), logical_weight(node)
    if x.type.rank < 3 or w.type.rank != x.type.rank:
        raise ModelError(
            f"{node.describe()}: input {x.type} and weight {w.type} must both be "
            "N x C x spatial... of the same rank"
        )
    if w.type.dtype != x.type.dtype:
        raise ModelError(f"{node.describe()}: weight dtype {w.type.dtype} differs from the input's "
                         f"{x.type.dtype}")
    if not all(isinstance(d, int) for d in w.type.shape):
        raise ModelError(f"{node.describe()}: the weight shape must be static, got {w.type}")
    group = int(attr(node, "group"))
    if group < 1:
        raise ModelError(f"{node.describe()}: group = {group} must be >= 1")
    return x, w, group


def _check_bias(node: Node, channels: int) -> None:
    b = node.input(2)
    if b is not None and tuple(b.type.shape) != (channels,):
        raise ModelError(f"{node.describe()}: bias shape {b.type} should be [{channels}]")


def conv_window(node: Node, ctx: InferContext) -> Window:
    x, w = required_input(node, 0), logical_weight(node)
    return window(node, ctx, x.type.shape[2:], _kernel(node, w))


@register
class Conv(Op):
    op_type = "Conv"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x, w, group = _check_operands(node, self)
        m, cw = (int(d) for d in w.type.shape[:2])
        c_in = x.type.shape[1]
        if m % group:
            raise ModelError(f"{node.describe()}: {m} output channels do not split into {group} groups")
        ctx.dims_equal(node, c_in, cw * group, "input channels vs weight channels x group")
        _check_bias(node, m)
        win = conv_window(node, ctx)
        y = TensorType(x.type.dtype, (x.type.shape[0], m, *win.out))
        check_fused_inputs(node, y)
        return [y]

    def scratch_bytes(self, node: Node) -> Dim:
        if node.outputs[0].type.dtype.name != "float32":
            return 0
        win = conv_window(node, UNCHECKED)
        if WINOGRAD_TILE in node.attrs:
            return winograd_bytes(node, win)
        if BF16_WEIGHTS in node.attrs:
            return im2col_bytes(node, win)
        if uses_direct_depthwise(node):
            return depthwise_scratch_bytes(node)
        return im2col_bytes(node, win)

    def path(self, node: Node) -> str:
        if WINOGRAD_TILE in node.attrs:
            return "winograd bf16" if BF16_WEIGHTS in node.attrs else "winograd"
        if BF16_WEIGHTS in node.attrs:
            return "bf16"
        return "transposed" if node.attrs.get(TRANSPOSED) else ""

    def derived_bytes(self, node: Node) -> int:
        if WINOGRAD_TILE in node.attrs:  # U (bf16 U: its float32 copy, as below)
            return weight_bytes(node)
        if BF16_WEIGHTS in node.attrs:  # float32 panels, for CPUs without bf16 instructions
            return int(logical_weight(node).type.nbytes)
        return 0

    def derived_on_demand(self, node: Node) -> bool:
        return BF16_WEIGHTS in node.attrs

    def derived_value(self, node: Node) -> np.ndarray | None:
        if WINOGRAD_TILE in node.attrs and BF16_WEIGHTS not in node.attrs:
            return stored_weight_transform(node)
        return None

    def replaced_inputs(self, node: Node) -> tuple[int, ...]:
        # U replaces the 3x3 kernels (bf16 U is the weight itself)
        return (1,) if WINOGRAD_TILE in node.attrs and BF16_WEIGHTS not in node.attrs else ()

    def lower_derived(self, node: Node, k: Emitter) -> None:
        if WINOGRAD_TILE in node.attrs and BF16_WEIGHTS in node.attrs:
            derive_float32_u(node, k)
        elif BF16_WEIGHTS in node.attrs:
            derive_float32_panels(node, k)
        else:
            lower_weight_transform(node, k)

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, w_val, b_val = required_input(node, 0), required_input(node, 1), node.input(2)
        win = conv_window(node, UNCHECKED)
        if WINOGRAD_TILE in node.attrs:  # chosen by ops/_conv_winograd.winograd_tile
            lower_conv_winograd(node, k, win)
            return
        if BF16_WEIGHTS in node.attrs:  # passes/bf16_weights.py
            lower_conv_gemm(node, k, win)
            return
        x, w, y = k.view(x_val), k.view(w_val), k.view(node.outputs[0])
        bias = k.view(b_val) if b_val is not None else None
        group = int(attr(node, "group"))
        m, cg = int(w_val.type.shape[0]), int(w_val.type.shape[1])
        mg = m // group
        if uses_direct_depthwise(node):
            lower_conv_depthwise(node, k, win)
            return
        if y.dtype.name == "float32":
            lower_conv_gemm(node, k, win)
            return
        assert FUSED_ACTIVATION not in node.attrs and node.input(RESIDUAL_SLOT) is None, \
            "epilogues are fused into float32 convs only"
        if compute_dtype(y.dtype) != y.dtype:
            _conv_gather(k, x, w, y, bias, win, cg, mg)
            return
        zero = k.const(y.dtype, 0.0)
        with k.loop(y.dims[0], name="n") as n, k.loop(m, name="m") as oc:
            g = k.b.sdiv(oc, k.i64(mg))
            init = k.load(bias, [oc]) if bias is not None else zero
            with k.loops(y.dims[2:], name="o") as o:
                k.store(y, [n, oc, *o], init)
            with k.loop(cg, name="c") as c:
                ic = k.b.add(k.b.mul(g, k.i64(cg)), c)
                with k.loops(win.kernel, name="kpos") as kpos:
                    wv = k.load(w, [oc, c, *kpos])
                    _accumulate_rows(k, x, y, n, oc, ic, kpos, wv, win)


def _walk_taps(k: Emitter, win: Window | TransposedWindow, kpos: Sequence[ir.Value],
               walk_dims: Sequence[ir.Value], reach_dims: Sequence[ir.Value],
               body: Callable[[list[ir.Value], list[ir.Value]], None]) -> None:
    """body(walked, reached) for every position `walked` (over walk_dims) whose partner
    `reached` = walked*s + kpos*d - pad lies inside reach_dims, for one kernel tap.

    Outer spatial dims are checked per position; the innermost one gets a computed valid range
    so its loop has no branch and vectorizes.
    """
    r = len(win.kernel)
    b = k.b

    def nest(axis: int, walked: list[ir.Value], reached: list[ir.Value]) -> None:
        s = win.strides[axis]
        offset = b.sub(b.mul(kpos[axis], k.i64(win.dilations[axis])), k.dim(win.pads_begin[axis]))
        if axis == r - 1:
            # valid w: 0 <= w*s + offset < size  ->  ceil(-offset/s) <= w < ceil((size-offset)/s)
            lo = clamp(k, ceil_div(k, b.neg(offset), s), k.i64(0), walk_dims[axis])
            hi = clamp(k, ceil_div(k, b.sub(reach_dims[axis], offset), s), lo, walk_dims[axis])
            with k.loop(hi, start=lo, name="w") as w:
                body([*walked, w], [*reached, b.add(b.mul(w, k.i64(s)), offset)])
            return
        with k.loop(walk_dims[axis], name=f"w{axis}") as w:
            t = b.add(b.mul(w, k.i64(s)), offset)
            inside = b.and_(b.icmp_signed(">=", t, k.i64(0)),
                            b.icmp_signed("<", t, reach_dims[axis]))
            with k.if_then(inside):
                nest(axis + 1, [*walked, w], [*reached, t])

    nest(0, [], [])


def _accumulate_rows(k: Emitter, x: View, y: View, n: ir.Value, oc: ir.Value, ic: ir.Value,
                     kpos: Sequence[ir.Value], wv: ir.Value, win: Window) -> None:
    """y[n, oc, o...] += wv * x[n, ic, o*s + kpos*d - pad] for every in-bounds output position."""

    def body(o: list[ir.Value], i: list[ir.Value]) -> None:
        idx = [n, oc, *o]
        k.store(y, idx, k.fmul_add(wv, k.load(x, [n, ic, *i]), k.load(y, idx)))

    _walk_taps(k, win, kpos, y.dims[2:], x.dims[2:], body)


def _conv_gather(k: Emitter, x: View, w: View, y: View, bias: View | None, win: Window,
                 cg: int, mg: int) -> None:
    """Each output element summed in a register of the compute dtype (float16 inputs)."""
    ct = compute_dtype(y.dtype)
    b = k.b
    r = len(win.kernel)
    acc = entry_alloca(k, k.const(ct, 0.0).type, "acc")
    with k.loops(y.dims[:2], name="nm") as (n, oc), k.loops(y.dims[2:], name="o") as o:
        g = b.sdiv(oc, k.i64(mg))
        start = [b.sub(b.mul(o[a], k.i64(win.strides[a])), k.dim(win.pads_begin[a]))
                 for a in range(r)]
        ranges = [kernel_range(k, start[a], x.dims[2 + a], win.dilations[a], win.kernel[a])
                  for a in range(r)]
        init = k.load(bias, [oc]) if bias is not None else k.const(y.dtype, 0.0)
        b.store(k.convert(init, y.dtype, ct), acc)
        with k.loop(cg, name="c") as c, _ranges(k, ranges) as kpos:
            ic = b.add(b.mul(g, k.i64(cg)), c)
            pos = [b.add(start[a], b.mul(kpos[a], k.i64(win.dilations[a]))) for a in range(r)]
            xv = k.convert(k.load(x, [n, ic, *pos]), x.dtype, ct)
            wv = k.convert(k.load(w, [oc, c, *kpos]), w.dtype, ct)
            b.store(k.fmul_add(wv, xv, b.load(acc)), acc)
        k.store(y, [n, oc, *o], k.convert(b.load(acc), ct, y.dtype))


@contextmanager
def _ranges(k: Emitter, ranges: Sequence[tuple[ir.Value, ir.Value]]) -> Iterator[list[ir.Value]]:
    """Nested loops over [lo, hi) per entry, outermost first."""
    if not ranges:
        yield []
        return
    lo, hi = ranges[0]
    with k.loop(hi, start=lo, name="kp") as i, _ranges(k, ranges[1:]) as rest:
        yield [i, *rest]


# -- ConvTranspose ---------------------------------------------------------------------------


def _ints(node: Node, name: str, default: int, r: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in node.attrs.get(name, [default] * r))
    if len(values) != r:
        raise ModelError(f"{node.describe()}: {name} {list(values)} must have {r} entries "
                         "(one per spatial dim)")
    return values


def transposed_window(node: Node, ctx: InferContext) -> TransposedWindow:
    x, w = required_input(node, 0), required_input(node, 1)
    spatial = x.type.shape[2:]
    r = len(spatial)
    kernel = _kernel(node, w)
    strides = _ints(node, "strides", 1, r)
    dilations = _ints(node, "dilations", 1, r)
    out_pad = _ints(node, "output_padding", 0, r)
    if min(strides + dilations, default=1) < 1 or min(out_pad, default=0) < 0:
        raise ModelError(f"{node.describe()}: strides and dilations must be >= 1, output_padding "
                         ">= 0")
    for axis, (p, s, d) in enumerate(zip(out_pad, strides, dilations)):
        if p >= max(s, d):
            raise ModelError(f"{node.describe()}: output_padding {list(out_pad)} must be smaller "
                             f"than the stride or the dilation (axis {axis}: {p} >= max({s}, {d}))")
    auto_pad = auto_pad_of(node)
    # the output of an unpadded transposed convolution
    full = [simplify_dim(s * (sympy.sympify(n) - 1) + p + (kk - 1) * d + 1)
            for n, s, p, kk, d in zip(spatial, strides, out_pad, kernel, dilations)]

    def split(total: list[Dim]) -> list[Dim]:
        # the ONNX rule: SAME_UPPER drops the odd element at the end, all others at the start
        half = [simplify_dim(sympy.floor(sympy.sympify(t) / 2)) for t in total]
        if auto_pad == "SAME_UPPER":
            return half
        return [simplify_dim(t - h) for t, h in zip(total, half)]

    if "output_shape" in node.attrs:
        out = [int(v) for v in node.attrs["output_shape"]]
        if len(out) == r + 2:
            out = out[2:]
        if len(out) != r or min(out, default=1) < 1:
            raise ModelError(f"{node.describe()}: output_shape {node.attrs['output_shape']} must "
                             f"have {r} positive entries (the spatial dims)")
        # an output_shape beyond the full output gets zeros at the end, as output_padding would
        # (onnxruntime and onnx's backend tests agree); so it is bounded as output_padding is
        for axis, (f, o) in enumerate(zip(full, out)):
            bound = max(strides[axis], dilations[axis])
            excess = simplify_dim(o - f + out_pad[axis])
            message = (f"output_shape[{axis}] = {o} exceeds the unpadded output ({f - out_pad[axis]}) "
                       f"by {excess}, which must be smaller than the stride or the dilation "
                       f"({bound})")
            if isinstance(excess, int):
                if excess >= bound:
                    raise ModelError(f"{node.describe()}: {message}")
            else:
                ctx.require(node, sympy.Lt(excess, bound), message)
        total = [simplify_dim(sympy.Max(0, f - o)) for f, o in zip(full, out)]
        return TransposedWindow(kernel, strides, dilations, tuple(split(total)), tuple(out))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [simplify_dim(sympy.sympify(n) * s) for n, s in zip(spatial, strides)]
        total = [simplify_dim(f - o) for f, o in zip(full, out)]
        for axis, t in enumerate(total):
            if not isinstance(t, int) or t < 0:
                raise UnsupportedOpError(
                    f"{node.describe()}: auto_pad {auto_pad} with stride {strides[axis]} larger "
                    f"than the dilated kernel plus output_padding on spatial axis {axis}: "
                    "onnxruntime and the ONNX reference disagree on this output; give explicit "
                    "pads (and output_padding) instead"
                )
        return TransposedWindow(kernel, strides, dilations, tuple(split(total)), tuple(out))
    pads = [int(p) for p in node.attrs.get("pads", [0] * (2 * r))] if auto_pad == "NOTSET" \
        else [0] * (2 * r)
    if len(pads) != 2 * r or min(pads, default=0) < 0:
        raise ModelError(f"{node.describe()}: pads {pads} must be {2 * r} non-negative ints")
    out = [simplify_dim(f - pads[a] - pads[r + a]) for a, f in enumerate(full)]
    for axis, o in enumerate(out):
        ctx.require(node, sympy.Ge(o, 1) if not isinstance(o, int) else o >= 1,
                    f"spatial dim {axis}: the pads remove the whole output")
    return TransposedWindow(kernel, strides, dilations, tuple(pads[:r]), tuple(out))


@register
class ConvTranspose(Op):
    op_type = "ConvTranspose"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x, w, group = _check_operands(node, self)
        c_in, c_w = x.type.shape[1], int(w.type.shape[0])
        if c_w % group:
            raise ModelError(f"{node.describe()}: weight channels {c_w} do not split into "
                             f"{group} groups")
        ctx.dims_equal(node, c_in, c_w, "input channels vs the weight's first dim")
        m = int(w.type.shape[1]) * group
        _check_bias(node, m)
        win = transposed_window(node, ctx)
        return [TensorType(x.type.dtype, (x.type.shape[0], m, *win.out))]

    def scratch_bytes(self, node: Node) -> Dim:
        return conv_transpose_scratch(node) if node.outputs[0].type.dtype == F32_DTYPE else 0

    def path(self, node: Node) -> str:
        return "gemm" if node.outputs[0].type.dtype == F32_DTYPE else ""

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, w_val, b_val = required_input(node, 0), required_input(node, 1), node.input(2)
        win = transposed_window(node, UNCHECKED)
        x, w, y = k.view(x_val), k.view(w_val), k.view(node.outputs[0])
        bias = k.view(b_val) if b_val is not None else None
        group = int(attr(node, "group"))
        cg, mg = int(w_val.type.shape[0]) // group, int(w_val.type.shape[1])
        if y.dtype == F32_DTYPE:
            lower_conv_transpose_gemm(node, k, win)
            return
        assert FUSED_ACTIVATION not in node.attrs, "activations are fused into float32 only"
        if compute_dtype(y.dtype) != y.dtype:
            _transposed_gather(k, x, w, y, bias, win, cg, mg)
            return
        b = k.b
        zero = k.const(y.dtype, 0.0)
        with k.loop(y.dims[0], name="n") as n, k.loop(mg * group, name="m") as oc:
            g = b.sdiv(oc, k.i64(mg))
            m_in_g = b.srem(oc, k.i64(mg))
            init = k.load(bias, [oc]) if bias is not None else zero
            with k.loops(y.dims[2:], name="o") as o:
                k.store(y, [n, oc, *o], init)
            with k.loop(cg, name="c") as c:
                ic = b.add(b.mul(g, k.i64(cg)), c)
                with k.loops(win.kernel, name="kpos") as kpos:
                    wv = k.load(w, [ic, m_in_g, *kpos])
                    _scatter_rows(k, x, y, n, oc, ic, kpos, wv, win)


def _scatter_rows(k: Emitter, x: View, y: View, n: ir.Value, oc: ir.Value, ic: ir.Value,
                  kpos: Sequence[ir.Value], wv: ir.Value, win: TransposedWindow) -> None:
    """y[n, oc, i*s + kpos*d - pad] += wv * x[n, ic, i] for every input position i whose
    target is inside the output."""

    def body(i: list[ir.Value], o: list[ir.Value]) -> None:
        idx = [n, oc, *o]
        k.store(y, idx, k.fmul_add(wv, k.load(x, [n, ic, *i]), k.load(y, idx)))

    _walk_taps(k, win, kpos, x.dims[2:], y.dims[2:], body)


def _transposed_gather(k: Emitter, x: View, w: View, y: View, bias: View | None,
                       win: TransposedWindow, cg: int, mg: int) -> None:
    """Each output element summed in a register of the compute dtype (float16 inputs): tap kp
    reads input i = (o + pad - kp*d) / s when that division is exact and i is in range."""
    ct = compute_dtype(y.dtype)
    b = k.b
    r = len(win.kernel)
    acc = entry_alloca(k, k.const(ct, 0.0).type, "acc")
    with k.loops(y.dims[:2], name="nm") as (n, oc), k.loops(y.dims[2:], name="o") as o:
        g = b.sdiv(oc, k.i64(mg))
        m_in_g = b.srem(oc, k.i64(mg))
        init = k.load(bias, [oc]) if bias is not None else k.const(y.dtype, 0.0)
        b.store(k.convert(init, y.dtype, ct), acc)
        with k.loops(win.kernel, name="kpos") as kpos:
            ok = ir.Constant(ir.IntType(1), 1)
            pos = []
            for a in range(r):
                t = b.sub(b.add(o[a], k.dim(win.pads_begin[a])),
                          b.mul(kpos[a], k.i64(win.dilations[a])))
                i = k.floordiv(t, k.i64(win.strides[a]))
                exact = b.icmp_signed("==", b.mul(i, k.i64(win.strides[a])), t)
                inside = b.and_(b.icmp_signed(">=", i, k.i64(0)),
                                b.icmp_signed("<", i, x.dims[2 + a]))
                ok = b.and_(ok, b.and_(exact, inside))
                pos.append(i)
            with k.if_then(ok), k.loop(cg, name="c") as c:
                ic = b.add(b.mul(g, k.i64(cg)), c)
                xv = k.convert(k.load(x, [n, ic, *pos]), x.dtype, ct)
                wv = k.convert(k.load(w, [ic, m_in_g, *kpos]), w.dtype, ct)
                b.store(k.fmul_add(wv, xv, b.load(acc)), acc)
        k.store(y, [n, oc, *o], k.convert(b.load(acc), ct, y.dtype))


# -- Col2Im -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Col2ImGeometry:
    image: tuple[Dim, ...]
    block: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    blocks: tuple[Dim, ...]  # block positions along each spatial axis


def _col2im_geometry(node: Node, ctx: InferContext) -> _Col2ImGeometry:
    x = required_input(node, 0)
    if x.type.rank != 3:
        raise ModelError(f"{node.describe()}: the input {x.type} must have rank 3: "
                         "[N, C * prod(block_shape), L]")
    image_v = const_or_symbolic_input(node, 1, "image_shape")
    block_v = const_input(node, 2, "block_shape")
    if image_v is None or block_v is None:
        raise ModelError(f"{node.describe()}: the image_shape and block_shape inputs are required")
    image = tuple(simplify_dim(d) for d in image_v)
    block = tuple(int(b) for b in np.asarray(block_v).reshape(-1))
    r = len(image)
    if r < 1 or len(block) != r:
        raise ModelError(f"{node.describe()}: image_shape {list(image)} and block_shape "
                         f"{list(block)} must list the same number (>= 1) of spatial dims")
    if any(b < 1 for b in block):
        raise ModelError(f"{node.describe()}: block_shape {list(block)} must be positive")

    def ints(name: str, default: int, count: int, least: int) -> tuple[int, ...]:
        values = tuple(int(v) for v in node.attrs.get(name, [default] * count))
        if len(values) != count or any(v < least for v in values):
            raise ModelError(f"{node.describe()}: {name} {list(values)} must hold {count} values "
                             f">= {least} for {r} spatial dims")
        return values

    strides = ints("strides", 1, r, 1)
    dilations = ints("dilations", 1, r, 1)
    pads = ints("pads", 0, 2 * r, 0)
    blocks = []
    for a in range(r):
        if not isinstance(image[a], int):
            ctx.require(node, sympy.Ge(image[a], 1), f"image_shape[{a}] ({image[a]}) must be >= 1")
        elif image[a] < 1:
            raise ModelError(f"{node.describe()}: image_shape {list(image)} must be positive")
        span = simplify_dim(image[a] + pads[a] + pads[r + a] - dilations[a] * (block[a] - 1) - 1)
        if isinstance(span, int) and span < 0:
            raise ModelError(f"{node.describe()}: the dilated block ({dilations[a] * (block[a] - 1) + 1}) "
                             f"does not fit in the padded image along spatial dim {a}")
        if not isinstance(span, int):
            ctx.require(node, sympy.Ge(span, 0), f"the dilated block must fit in the padded image "
                        f"along spatial dim {a}")
        blocks.append(simplify_dim(sympy.floor(sympy.sympify(span) / strides[a]) + 1))
    taps = int(np.prod(block))
    channels = x.type.shape[1]
    if isinstance(channels, int) and channels % taps:
        raise ModelError(f"{node.describe()}: input dim 1 ({channels}) is not a multiple of the "
                         f"block size prod({list(block)}) = {taps}")
    if not isinstance(channels, int):
        ctx.require(node, sympy.Eq(sympy.Mod(channels, taps), 0),
                    f"input dim 1 ({channels}) must be a multiple of the block size {taps}")
    ctx.dims_equal(node, x.type.shape[2], numel(blocks),
                   "input dim 2 (L) must equal the number of block positions")
    return _Col2ImGeometry(image, block, strides, dilations, pads[:r], tuple(blocks))


@register
class Col2Im(Op):
    """Sums column blocks back into an image: each output element gathers the block taps that
    land on it (tap t at block position l covers o = l*s + t*d - pad), accumulated in a
    register (float32 for float16) and stored once."""

    op_type = "Col2Im"
    since = 18
    dtypes = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        g = _col2im_geometry(node, ctx)
        channels = simplify_dim(sympy.sympify(x.type.shape[1]) / int(np.prod(g.block)))
        return [TensorType(x.type.dtype, (x.type.shape[0], channels, *g.image))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, y_val = node.inputs[0], node.outputs[0]
        assert x_val is not None
        g = _col2im_geometry(node, UNCHECKED)
        r = len(g.block)
        taps = int(np.prod(g.block))
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype,
                         (y_val.type.shape[0], y_val.type.shape[1], *g.block, *g.blocks))
        y = k.view(y_val)
        ct = compute_dtype(y.dtype)
        b = k.b
        acc = entry_alloca(k, k.const(ct, 0).type, "acc")
        blocks = [k.dim(d) for d in g.blocks]
        assert taps >= 1
        with k.loops(y.dims[:2], name="nc") as (n, c), k.loops(y.dims[2:], name="o") as o:
            b.store(k.const(ct, 0), acc)
            with k.loops(g.block, name="tap") as tap:
                ok = ir.Constant(ir.IntType(1), 1)
                pos = []
                for a in range(r):
                    t = b.sub(b.add(o[a], k.i64(g.pads_begin[a])), b.mul(tap[a], k.i64(g.dilations[a])))
                    i = k.floordiv(t, k.i64(g.strides[a]))
                    exact = b.icmp_signed("==", b.mul(i, k.i64(g.strides[a])), t)
                    inside = b.and_(b.icmp_signed(">=", i, k.i64(0)), b.icmp_signed("<", i, blocks[a]))
                    ok = b.and_(ok, b.and_(exact, inside))
                    pos.append(i)
                with k.if_then(ok):
                    v = k.convert(k.load(x, [n, c, *tap, *pos]), x.dtype, ct)
                    b.store(k.add(ct, b.load(acc), v), acc)
            k.store(y, [n, c, *o], k.convert(b.load(acc), ct, y.dtype))


#: what passes read: the choice of Winograd tile (winograd_weights), and which convolutions
#: read their weights in ONNX's layout (pack_gemm_weights)
__all__ = ["TRANSPOSED", "U_STORED", "WINOGRAD_TILE", "bf16_weight_transform", "runs_in_bf16",
           "transposed_product", "uses_direct_depthwise", "winograd_tile"]
