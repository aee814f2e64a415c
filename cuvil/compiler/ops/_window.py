"""Sliding-window geometry shared by Conv and the pooling ops (pads, strides, output size),
and the small code generation helpers the windowed and matrix ops share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, simplify_dim
from cuvil.compiler.kernels.emitter import Emitter
from cuvil.compiler.ops import InferContext
from cuvil.errors import ModelError


@dataclass(frozen=True)
class Window:
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[Dim, ...]
    pads_end: tuple[Dim, ...]
    out: tuple[Dim, ...]


@dataclass(frozen=True)
class TransposedWindow:
    """Output position o receives input i through kernel tap kp when o = i*s + kp*d - pad."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[Dim, ...]
    out: tuple[Dim, ...]


def auto_pad_of(node: Node) -> str:
    """The auto_pad attribute; an empty string means NOTSET (as in onnxruntime)."""
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    auto_pad = auto_pad or "NOTSET"
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ModelError(f"{node.describe()}: unknown auto_pad {auto_pad!r}; expected NOTSET, "
                         "SAME_UPPER, SAME_LOWER or VALID")
    return auto_pad


def window(node: Node, ctx: InferContext, spatial: Sequence[Dim], kernel: Sequence[int],
           ceil_mode: bool = False) -> Window:
    r = len(spatial)
    kernel = tuple(int(x) for x in kernel)
    strides = tuple(int(x) for x in node.attrs.get("strides", [1] * r))
    dilations = tuple(int(x) for x in node.attrs.get("dilations", [1] * r))
    if len(kernel) != r or len(strides) != r or len(dilations) != r:
        raise ModelError(
            f"{node.describe()}: kernel {list(kernel)}, strides {list(strides)} and dilations "
            f"{list(dilations)} must each have {r} entries (one per spatial dim)"
        )
    if min(strides + dilations + kernel, default=1) < 1:
        raise ModelError(f"{node.describe()}: kernel, strides and dilations must be >= 1")
    auto_pad = auto_pad_of(node)
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [simplify_dim(sympy.ceiling(sympy.sympify(n) / s)) for n, s in zip(spatial, strides)]
        total = [simplify_dim(sympy.Max(0, (o - 1) * s + e - n))
                 for o, s, e, n in zip(out, strides, extent, spatial)]
        small = [simplify_dim(sympy.floor(sympy.sympify(t) / 2)) for t in total]
        big = [simplify_dim(t - h) for t, h in zip(total, small)]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        return Window(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))
    pads = [int(p) for p in node.attrs.get("pads", [0] * (2 * r))] if auto_pad == "NOTSET" \
        else [0] * (2 * r)
    if len(pads) != 2 * r or min(pads, default=0) < 0:
        raise ModelError(f"{node.describe()}: pads {pads} must be {2 * r} non-negative ints")
    begin, end = pads[:r], pads[r:]
    out = []
    for axis in range(r):
        span = sympy.sympify(spatial[axis]) + begin[axis] + end[axis] - extent[axis]
        if ceil_mode:
            # windows that would start in the right padding are dropped: a window o starts
            # inside the input or its left padding when o*s < n + pad_begin
            o = simplify_dim(sympy.Min(
                sympy.ceiling(span / strides[axis]) + 1,
                sympy.ceiling((sympy.sympify(spatial[axis]) + begin[axis]) / strides[axis])))
        else:
            o = simplify_dim(sympy.floor(span / strides[axis]) + 1)
        ctx.require(node, sympy.Ge(o, 1) if not isinstance(o, int) else o >= 1,
                    f"spatial dim {axis} is smaller than the window")
        out.append(o)
    return Window(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))


# -- code generation helpers shared by the windowed ops --------------------------------------


def entry_alloca(k: Emitter, ty: ir.Type, name: str = "") -> ir.Value:
    """A scalar stack slot made in the entry block, so LLVM keeps it in a register (an alloca
    inside a loop would grow the stack on every iteration)."""
    with k.b.goto_block(k.function.entry_basic_block):
        return k.b.alloca(ty, name=name)


def ceil_div(k: Emitter, a: ir.Value, s: int | ir.Value) -> ir.Value:
    """ceil(a / s) for a positive s (a constant or an i64 value) and any sign of a."""
    return k.b.neg(k.floordiv(k.b.neg(a), s if isinstance(s, ir.Value) else k.i64(s)))


def clamp(k: Emitter, v: ir.Value, lo: ir.Value, hi: ir.Value) -> ir.Value:
    b = k.b
    v = b.select(b.icmp_signed("<", v, lo), lo, v)
    return b.select(b.icmp_signed(">", v, hi), hi, v)


def kernel_range(k: Emitter, start: ir.Value, size: ir.Value, dilation: int,
                 kernel: int) -> tuple[ir.Value, ir.Value]:
    """The kernel positions [lo, hi) whose input index start + kp*dilation is in [0, size)."""
    lo = clamp(k, ceil_div(k, k.b.neg(start), dilation), k.i64(0), k.i64(kernel))
    hi = clamp(k, ceil_div(k, k.b.sub(size, start), dilation), lo, k.i64(kernel))
    return lo, hi
