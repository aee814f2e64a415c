"""Spectral ops: DFT (opset 17 and 20) and STFT.

Complex tensors are real tensors whose last dim (2) holds the real and imaginary parts; a
real signal has a last dim of 1. Each transformed line is copied into the node's scratch
memory as complex float64 (zero-padded or truncated to the DFT length), transformed there,
and written back in the output's dtype, so float32 and float16 accumulate in float64.

The transform is a mixed-radix Stockham FFT (self-sorting, ping-ponging between two
buffers): the length is factored at run time (radix 4 while it divides, then prime factors)
and each factor p is one pass of p-point DFTs, so power-of-two lengths cost O(n log n) and a
prime length degenerates to the direct O(n^2) sum. Twiddle factors come from one table of
the n-th roots of unity: a constant in the library for static lengths up to `MAX_TABLE`,
filled once per call in scratch memory for longer and symbolic ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value, numel, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter, View
from cuvil.compiler.ops import (
    FLOATS,
    UNCHECKED,
    InferContext,
    Op,
    attr,
    const_input,
    const_or_symbolic_input,
    register,
)
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError

F64 = ir.DoubleType()

#: receives (k, line buffer, length) and fills the buffer with one line's complex samples
Fill = Callable[[Emitter, ir.Value, ir.Value], None]


# -- shape rules ------------------------------------------------------------------------------


def _signal(node: Node, op: Op, what: str = "input") -> tuple[Value, int]:
    """The signal input and its number of components (1: real, 2: complex)."""
    op.check_dtypes(node)
    x = node.input(0)
    if x is None:
        raise ModelError(f"{node.describe()}: the {what} is required")
    if x.type.rank < 2:
        raise ModelError(f"{node.describe()}: the {what} {x.type} must have rank >= 2: signal "
                         "dims, then a last dim of 1 (real) or 2 (real, imaginary)")
    c = x.type.shape[-1]
    if c not in (1, 2):
        raise ModelError(f"{node.describe()}: the {what}'s last dim is {c}; it must be 1 (a real "
                         "signal) or 2 (real and imaginary parts)")
    return x, int(c)


def _scalar(node: Node, i: int, what: str, symbolic: bool = True) -> Dim | None:
    """A scalar integer input known at compile time (None when absent)."""
    v = node.input(i)
    if v is None:
        return None
    if v.type.dtype.kind not in "iu":
        raise ModelError(f"{node.describe()}: {what} {v.name!r} must be int32 or int64, got "
                         f"{v.type.dtype.name}")
    if symbolic:
        values = const_or_symbolic_input(node, i, what)
    else:
        const = const_input(node, i, what)
        values = None if const is None else tuple(int(x) for x in np.asarray(const).reshape(-1))
    assert values is not None
    if len(values) != 1:
        raise ModelError(f"{node.describe()}: {what} must be a scalar, got {len(values)} values")
    return simplify_dim(values[0])


def _positive(node: Node, ctx: InferContext, d: Dim, what: str) -> Dim:
    if isinstance(d, int):
        if d < 1:
            raise ModelError(f"{node.describe()}: {what} is {d}; it must be at least 1")
    else:
        ctx.require(node, sympy.Ge(d, 1), f"{what} ({d}) must be at least 1")
    return d


def _flag(node: Node, name: str, default: int) -> bool:
    v = int(node.attrs.get(name, default))
    if v not in (0, 1):
        raise ModelError(f"{node.describe()}: attribute {name} = {v}; it must be 0 or 1")
    return bool(v)


def _half(n: Dim) -> Dim:
    """n // 2 + 1: the bins of a one-sided spectrum."""
    return simplify_dim(sympy.floor(sympy.sympify(n) / 2) + 1) if not isinstance(n, int) \
        else n // 2 + 1


@dataclass(frozen=True)
class _DftGeometry:
    axis: int
    length: Dim  # the DFT length
    inverse: bool
    onesided: bool
    components: int  # of the input: 1 real, 2 complex

    @property
    def irfft(self) -> bool:
        return self.inverse and self.onesided

    @property
    def out_components(self) -> int:
        return 1 if self.irfft else 2

    def out_len(self) -> Dim:
        return _half(self.length) if self.onesided and not self.inverse else self.length


class _DFT(Op):
    op_type = "DFT"
    dtypes = FLOATS

    def axis(self, node: Node, rank: int) -> int:
        raise NotImplementedError

    def geometry(self, node: Node, ctx: InferContext) -> _DftGeometry:
        x, c = _signal(node, self)
        r = x.type.rank
        axis = self.axis(node, r)
        if not (-r <= axis <= -2 or 0 <= axis <= r - 2):
            raise ModelError(f"{node.describe()}: axis {axis} is out of range for an input of rank "
                             f"{r}: it must be in [{-r}, -2] or [0, {r - 2}] (the last dim holds "
                             "the real and imaginary parts)")
        axis %= r
        inverse, onesided = _flag(node, "inverse", 0), _flag(node, "onesided", 0)
        if onesided and not inverse and c == 2:
            raise ModelError(f"{node.describe()}: a one-sided forward DFT takes a real input (last "
                             f"dim 1), got {x.type}; set onesided=0 for a complex input")
        n = x.type.shape[axis]
        length = _scalar(node, 1, "dft_length")
        if length is None and inverse and onesided:
            length = _positive(node, ctx, simplify_dim(2 * (n - 1)),
                               f"the default dft_length of a one-sided inverse DFT, 2 * ({n} - 1),")
        elif length is None:
            length = n
        else:
            _positive(node, ctx, length, "dft_length")
        return _DftGeometry(axis, length, inverse, onesided, c)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        g = self.geometry(node, ctx)
        assert x is not None
        shape = list(x.type.shape)
        shape[g.axis] = g.out_len()
        shape[-1] = g.out_components
        return [TensorType(x.type.dtype, tuple(shape))]

    def scratch_bytes(self, node: Node) -> Dim:
        return _scratch_bytes(self.geometry(node, UNCHECKED).length)

    def lower(self, node: Node, k: Emitter) -> None:
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        g = self.geometry(node, UNCHECKED)
        shape = x.type.shape
        outer, n_in, inner = numel(shape[:g.axis]), shape[g.axis], numel(shape[g.axis + 1:-1])
        xv = k.contiguous(k.buffers[x], x.type.dtype, (outer, n_in, inner, g.components))
        yv = k.contiguous(k.buffers[y], y.type.dtype, (outer, g.out_len(), inner, g.out_components))
        fft = _Fft(k, g.length, g.inverse)
        n_in_v = k.dim(n_in)
        with k.loops([xv.dims[0], xv.dims[2]], name="line") as (o, i):

            def sample(j: ir.Value) -> tuple[ir.Value, ir.Value]:
                re = _to_f64(k, k.load(xv, [o, j, i, k.i64(0)]), x.type.dtype)
                im = (_to_f64(k, k.load(xv, [o, j, i, k.i64(1)]), x.type.dtype)
                      if g.components == 2 else ir.Constant(F64, 0.0))
                return re, im

            make_fill = _hermitian_fill if g.irfft else _padded_fill
            out = fft.transform(make_fill(n_in_v, sample))
            _store_bins(k, out, yv, lambda j, part: [o, j, i, k.i64(part)], yv.dims[1],
                        g.out_components, fft.n, g.inverse)


@register
class DFT17(_DFT):
    """DFT-17 (also DFT-19 models): the axis is an attribute, 1 by default."""

    since = 17

    def axis(self, node: Node, rank: int) -> int:
        if node.input(2) is not None:
            raise ModelError(f"{node.describe()}: DFT before opset 20 takes the axis as an attribute, "
                             "not as input 2")
        return int(attr(node, "axis"))


@register
class DFT20(_DFT):
    """DFT-20: the axis is input 2, a compile-time scalar, -2 (the last signal axis) by default."""

    since = 20

    def axis(self, node: Node, rank: int) -> int:
        if "axis" in node.attrs:
            raise ModelError(f"{node.describe()}: DFT from opset 20 on takes the axis as input 2, "
                             "not as an attribute")
        v = _scalar(node, 2, "axis", symbolic=False)
        return -2 if v is None else int(v)


@dataclass(frozen=True)
class _StftGeometry:
    step: int
    length: Dim  # the frame length, also the DFT length
    frames: Dim
    onesided: bool
    components: int

    def out_len(self) -> Dim:
        return _half(self.length) if self.onesided else self.length


@register
class STFT(Op):
    op_type = "STFT"
    since = 17
    dtypes = FLOATS

    def geometry(self, node: Node, ctx: InferContext) -> _StftGeometry:
        x, c = _signal(node, self, "signal")
        if x.type.rank != 3:
            raise ModelError(f"{node.describe()}: the signal {x.type} must have rank 3: "
                             "[batch, signal_length, 1 or 2]")
        step = _scalar(node, 1, "frame_step", symbolic=False)
        if step is None:
            raise ModelError(f"{node.describe()}: the frame_step input is required")
        assert isinstance(step, int)
        _positive(node, ctx, step, "frame_step")
        window = node.input(2)
        length = _scalar(node, 3, "frame_length")
        if window is not None:
            if window.type.rank != 1:
                raise ModelError(f"{node.describe()}: the window {window.type} must be 1-D")
            if window.type.dtype != x.type.dtype:
                raise ModelError(f"{node.describe()}: the window's dtype {window.type.dtype} differs "
                                 f"from the signal's {x.type.dtype}")
            if length is None:
                length = window.type.shape[0]
            else:
                ctx.dims_equal(node, window.type.shape[0], length,
                               "the window's length must equal frame_length")
        if length is None:
            length = x.type.shape[1]
        _positive(node, ctx, length, "frame_length")
        n = x.type.shape[1]
        if isinstance(n, int) and isinstance(length, int) and length > n:
            raise ModelError(f"{node.describe()}: frame_length {length} is longer than the signal "
                             f"({n} samples)")
        if not (isinstance(n, int) and isinstance(length, int)):
            ctx.require(node, sympy.Ge(n, length),
                        f"frame_length ({length}) must not exceed the signal length ({n})")
        frames = simplify_dim(sympy.floor((sympy.sympify(n) - length) / step) + 1)
        return _StftGeometry(step, length, frames, _flag(node, "onesided", 1), c)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        g = self.geometry(node, ctx)
        assert x is not None
        return [TensorType(x.type.dtype, (x.type.shape[0], g.frames, g.out_len(), 2))]

    def scratch_bytes(self, node: Node) -> Dim:
        return _scratch_bytes(self.geometry(node, UNCHECKED).length)

    def lower(self, node: Node, k: Emitter) -> None:
        x, window, y = node.inputs[0], node.input(2), node.outputs[0]
        assert x is not None
        g = self.geometry(node, UNCHECKED)
        dt = x.type.dtype
        xv = k.view(x)
        wv = k.view(window) if window is not None else None
        yv = k.view(y)
        fft = _Fft(k, g.length, inverse=False)
        with k.loops([xv.dims[0], k.dim(g.frames)], name="frame") as (bi, f):
            start = k.b.mul(f, k.i64(g.step))

            def sample(j: ir.Value) -> tuple[ir.Value, ir.Value]:
                t = k.b.add(start, j)
                re = _to_f64(k, k.load(xv, [bi, t, k.i64(0)]), dt)
                im = (_to_f64(k, k.load(xv, [bi, t, k.i64(1)]), dt)
                      if g.components == 2 else ir.Constant(F64, 0.0))
                if wv is not None:
                    w = _to_f64(k, k.load(wv, [j]), dt)
                    re = k.b.fmul(re, w)
                    if g.components == 2:
                        im = k.b.fmul(im, w)
                return re, im

            out = fft.transform(_padded_fill(fft.n, sample))
            _store_bins(k, out, yv, lambda j, part: [bi, f, j, k.i64(part)], yv.dims[2], 2, fft.n,
                        inverse=False)


# -- lowering helpers -------------------------------------------------------------------------


#: longest DFT whose twiddle table is a constant in the library (16 bytes per entry); longer
#: and symbolic lengths fill it in scratch memory on each call
MAX_TABLE = 1 << 14


def _table_in_library(length: Dim) -> bool:
    return isinstance(length, int) and length <= MAX_TABLE


def _scratch_bytes(length: Dim) -> Dim:
    """Two line buffers of complex float64, plus the twiddle table unless it is a constant."""
    buffers = 2 if _table_in_library(length) else 3
    return simplify_dim(buffers * 16 * length)


def _to_f64(k: Emitter, v: ir.Value, dtype: np.dtype) -> ir.Value:
    return k.convert(v, dtype, np.dtype(np.float64))


def _cptr(k: Emitter, buf: ir.Value, i: ir.Value, part: int) -> ir.Value:
    off = k.b.add(k.b.mul(i, k.i64(2)), k.i64(part)) if part else k.b.mul(i, k.i64(2))
    return k.b.gep(buf, [off], source_etype=F64, inbounds=True)


def _cload(k: Emitter, buf: ir.Value, i: ir.Value) -> tuple[ir.Value, ir.Value]:
    return (k.b.load(_cptr(k, buf, i, 0), typ=F64), k.b.load(_cptr(k, buf, i, 1), typ=F64))


def _cstore(k: Emitter, buf: ir.Value, i: ir.Value, re: ir.Value, im: ir.Value) -> None:
    k.b.store(re, _cptr(k, buf, i, 0))
    k.b.store(im, _cptr(k, buf, i, 1))


def _cmul(k: Emitter, a: tuple[ir.Value, ir.Value], w: tuple[ir.Value, ir.Value]
          ) -> tuple[ir.Value, ir.Value]:
    b = k.b
    return (b.fsub(b.fmul(a[0], w[0]), b.fmul(a[1], w[1])),
            b.fadd(b.fmul(a[0], w[1]), b.fmul(a[1], w[0])))


def _padded_fill(n_in: ir.Value, sample: Callable[[ir.Value], tuple[ir.Value, ir.Value]]) -> Fill:
    """The line's first min(n_in, n) samples, then zeros up to the DFT length n."""

    def fill(k: Emitter, buf: ir.Value, n: ir.Value) -> None:
        used = k.b.select(k.b.icmp_signed("<", n_in, n), n_in, n)
        with k.loop(used, name="ld") as j:
            _cstore(k, buf, j, *sample(j))
        zero = ir.Constant(F64, 0.0)
        with k.loop(n, start=used, name="pad") as j:
            _cstore(k, buf, j, zero, zero)

    return fill


def _hermitian_fill(bins: ir.Value, sample: Callable[[ir.Value], tuple[ir.Value, ir.Value]]) -> Fill:
    """The full spectrum of a real signal from its one-sided half: X[j] = conj(X[n - j]) for
    j > n/2; bins beyond those given are zero. (The imaginary parts of X[0] and X[n/2] only
    reach the imaginary part of the result, which a one-sided inverse drops.)"""

    def fill(k: Emitter, buf: ir.Value, n: ir.Value) -> None:
        b = k.b
        half = b.sdiv(n, k.i64(2))
        zero = ir.Constant(F64, 0.0)
        with k.loop(n, name="herm") as j:
            mirrored = b.icmp_signed(">", j, half)
            src = b.select(mirrored, b.sub(n, j), j)
            given = b.icmp_signed("<", src, bins)
            with b.if_else(given) as (then, otherwise):
                with then:
                    re, im = sample(src)
                    _cstore(k, buf, j, re, b.select(mirrored, b.fneg(im), im))
                with otherwise:
                    _cstore(k, buf, j, zero, zero)

    return fill


def _store_bins(k: Emitter, out: ir.Value, yv: View, index: Callable[[ir.Value, int], list[ir.Value]],
                bins: ir.Value, components: int, n: ir.Value, inverse: bool) -> None:
    """Write the first `bins` values of the transformed line to y at `index(bin, part)`;
    an inverse transform scales them by 1/n."""
    b = k.b
    factor = b.fdiv(ir.Constant(F64, 1.0), b.sitofp(n, F64)) if inverse else None
    with k.loop(bins, name="bin") as j:
        parts = _cload(k, out, j)
        for part in range(components):
            v = parts[part] if factor is None else b.fmul(parts[part], factor)
            k.store(yv, index(j, part), k.convert(v, np.dtype(np.float64), yv.dtype))


class _Fft:
    """The transform of one line of `length` complex float64 values in scratch memory."""

    def __init__(self, k: Emitter, length: Dim, inverse: bool) -> None:
        assert k.scratch is not None
        self.k = k
        self.n = k.dim(length)
        b = k.b
        self.bufs = (k.scratch, b.gep(k.scratch, [b.mul(self.n, k.i64(2))], source_etype=F64))
        sign = 1.0 if inverse else -1.0
        if _table_in_library(length):
            assert isinstance(length, int)
            roots = np.exp(sign * 2j * np.pi * np.arange(length) / length)
            table = np.stack([roots.real, roots.imag], axis=-1).reshape(-1)
            ty = ir.ArrayType(F64, table.size)
            g = ir.GlobalVariable(k.module, ty, k.module.get_unique_name(f"{k.function.name}.roots"))
            g.linkage = "private"
            g.global_constant = True
            g.unnamed_addr = True
            g.initializer = ir.Constant(ty, [float(v) for v in table])
            self.roots = b.gep(g, [k.i64(0), k.i64(0)], source_etype=ty, inbounds=True)
        else:
            self.roots = b.gep(k.scratch, [b.mul(self.n, k.i64(4))], source_etype=F64)
            step = b.fdiv(ir.Constant(F64, sign * 2 * np.pi), b.sitofp(self.n, F64))
            with k.loop(self.n, name="root") as j:
                angle = b.fmul(b.sitofp(j, F64), step)
                _cstore(k, self.roots, j, k.intrinsic("llvm.cos", [angle]),
                        k.intrinsic("llvm.sin", [angle]))

    def transform(self, fill: Fill) -> ir.Value:
        """Fill buffer 0, transform it; returns the buffer holding the result."""
        k, b, n = self.k, self.k.b, self.n
        fill(k, self.bufs[0], n)
        src = entry_alloca(k, ir.PointerType(), "src")
        dst = entry_alloca(k, ir.PointerType(), "dst")
        rest = entry_alloca(k, I64, "rest")  # length still to split: n / (product of radices)
        stride = entry_alloca(k, I64, "stride")
        radix = entry_alloca(k, I64, "radix")
        b.store(self.bufs[0], src)
        b.store(self.bufs[1], dst)
        b.store(n, rest)
        b.store(k.i64(1), stride)
        with _while(k, lambda: b.icmp_signed(">", b.load(rest, typ=I64), k.i64(1)), "stage"):
            m = b.load(rest, typ=I64)
            # the radix: 4 while it divides m (half the passes of radix 2), else the smallest
            # prime factor of m (m itself once the candidates pass sqrt(m))
            by4 = b.icmp_signed("==", b.srem(m, k.i64(4)), k.i64(0))
            b.store(b.select(by4, k.i64(4), k.i64(2)), radix)

            def searching() -> ir.Value:
                p = b.load(radix, typ=I64)
                below_root = b.icmp_signed("<=", b.mul(p, p), m)
                return b.and_(below_root, b.icmp_signed("!=", b.srem(m, p), k.i64(0)))

            with _while(k, searching, "factor"):
                b.store(b.add(b.load(radix, typ=I64), k.i64(1)), radix)
            p = b.load(radix, typ=I64)
            p = b.select(b.icmp_signed("==", b.srem(m, p), k.i64(0)), p, m)
            s = b.load(stride, typ=I64)
            x, y = b.load(src, typ=ir.PointerType()), b.load(dst, typ=ir.PointerType())
            self._pass(p, b.sdiv(m, p), s, x, y)
            b.store(y, src)
            b.store(x, dst)
            b.store(b.sdiv(m, p), rest)
            b.store(b.mul(s, p), stride)
        return b.load(src, typ=ir.PointerType())

    def _pass(self, r: ir.Value, m: ir.Value, s: ir.Value, x: ir.Value, y: ir.Value) -> None:
        """One Stockham pass of radix r: y[q + s*(r*p + j)] =
        w^(j*p*s) * sum_t x[q + s*(p + t*m)] * w^(j*t*n/r), with w the n-th root and n = r*m*s."""
        k, b, n = self.k, self.k.b, self.n
        acc_re = entry_alloca(k, F64, "acc.re")
        acc_im = entry_alloca(k, F64, "acc.im")
        at = entry_alloca(k, I64, "root")
        n_over_r = b.sdiv(n, r)
        span = b.mul(s, m)
        with k.loop(m, name="p") as p, k.loop(s, name="q") as q, k.loop(r, name="j") as j:
            base = b.add(q, b.mul(s, p))
            step = b.mul(j, n_over_r)
            b.store(ir.Constant(F64, 0.0), acc_re)
            b.store(ir.Constant(F64, 0.0), acc_im)
            b.store(k.i64(0), at)
            with k.loop(r, name="t") as t:
                v = _cload(k, x, b.add(base, b.mul(t, span)))
                idx = b.load(at, typ=I64)
                pr, pi = _cmul(k, v, _cload(k, self.roots, idx))
                b.store(b.fadd(b.load(acc_re, typ=F64), pr), acc_re)
                b.store(b.fadd(b.load(acc_im, typ=F64), pi), acc_im)
                nxt = b.add(idx, step)
                b.store(b.select(b.icmp_signed(">=", nxt, n), b.sub(nxt, n), nxt), at)
            acc = (b.load(acc_re, typ=F64), b.load(acc_im, typ=F64))
            out = _cmul(k, acc, _cload(k, self.roots, b.mul(b.mul(j, p), s)))
            _cstore(k, y, b.add(q, b.mul(s, b.add(b.mul(r, p), j))), *out)


class _while:
    """`while cond(): body` as a context manager around the body."""

    def __init__(self, k: Emitter, cond: Callable[[], ir.Value], name: str) -> None:
        self.k, self.cond, self.name = k, cond, name

    def __enter__(self) -> None:
        k = self.k
        self.head = k.function.append_basic_block(f"{self.name}.head")
        body = k.function.append_basic_block(f"{self.name}.body")
        self.done = k.function.append_basic_block(f"{self.name}.done")
        k.b.branch(self.head)
        k.b.position_at_end(self.head)
        k.b.cbranch(self.cond(), body, self.done)
        k.b.position_at_end(body)

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.k.b.branch(self.head)
            self.k.b.position_at_end(self.done)

