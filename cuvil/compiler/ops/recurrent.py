"""Recurrent layers: LSTM, GRU and RNN (ONNX opsets 7, 14 and 22).

All three share one structure. The input projection of every step does not depend on the
recurrence, so it is one product up front: ``proj[seq*batch, dirs*gates*hidden] = X @ W^T``
(biases folded in), through the shared GEMM kernel on the runtime's threads. Then, per
direction and step, the recurrent product ``gates[batch, :] = h @ R^T`` for all batch rows,
and the gate math of each row, which updates its states in place. Batch rows are
independent, which is what makes per-row sequence lengths simple: a row whose sequence has
ended keeps its state (so Y_h/Y_c hold its last valid step) and writes zeros into Y, as
onnxruntime does. The two directions of a bidirectional layer run on two threads. A single
direction splits each step over the threads by blocks of hidden units: a block computes its
units' columns of every gate (from all of h) and then their gate math, so the gate sums stay
in the cache of the core that made them and the gate math runs in parallel too. h is
double-buffered for that: a step reads one buffer whole and writes the other.

Constant float32 W and R are packed at compile time: W transposed (the GEMM kernel reads B
in rows), R^T in the column panels of the per-step kernel (`_recurrent_kernel`), which keeps
a few batch rows' sums in registers while it streams R once per step. The gate math is one
loop over a block's hidden units per row, vectorized (`vecmath`). Run-time weights and float64
use plain dot products instead, on one thread.

Scratch memory (the projection and, per direction, the states, gate sums and GRU's r*h) is
the node's workspace scratch (`scratch_bytes`).

Activation functions and their ``activation_alpha``/``activation_beta`` follow onnxruntime:
names are case-insensitive, the alpha (beta) list is consumed in order by the functions that
take an alpha (beta), and a missing value defaults to 0.01 (LeakyRelu), 0.2/0.5
(HardSigmoid), 1.0 (Elu), else 0. ``clip`` bounds the input of every activation but LSTM's
h (as onnxruntime). Sequence lengths outside [0, seq_length] fail the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, simplify_dim
from cuvil.compiler.kernels import vecmath
from cuvil.compiler.kernels.emitter import I64, PTR, Emitter, llvm_type
from cuvil.compiler.kernels.gemm import Epilogue, emit_gemm, emit_parallel_gemm
from cuvil.compiler.ops import UNCHECKED, InferContext, Op, attr, register
from cuvil.compiler.ops._recurrent_kernel import PANEL, emit_small_gemm, pack_panels, packed_rows
from cuvil.errors import ModelError, UnsupportedOpError

__all__ = ["GRU", "LSTM", "RNN"]

#: node attribute set once W is stored transposed and R in panels (constant float32 weights)
_PACKED = "cuvil.packed_weights"

# name -> (takes alpha, takes beta, default alpha, default beta), as onnxruntime reads them
_ACTIVATIONS: dict[str, tuple[bool, bool, float, float]] = {
    "relu": (False, False, 0.0, 0.0),
    "tanh": (False, False, 0.0, 0.0),
    "sigmoid": (False, False, 0.0, 0.0),
    "affine": (True, True, 0.0, 0.0),
    "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 0.0, 0.0),
    "scaledtanh": (True, True, 0.0, 0.0),
    "hardsigmoid": (True, True, 0.2, 0.5),
    "elu": (True, False, 1.0, 0.0),
    "softsign": (False, False, 0.0, 0.0),
    "softplus": (False, False, 0.0, 0.0),
}


@dataclass(frozen=True)
class Activation:
    name: str  # lower case
    alpha: float = 0.0
    beta: float = 0.0


def emit_activation(k: Emitter, act: Activation, x: ir.Value) -> ir.Value:
    """act(x) for a float scalar, in branch-free arithmetic (`vecmath`) so that the loops
    applying it vectorize; exp-based functions cannot overflow into NaN."""
    b = k.b
    ty = x.type

    def c(v: float) -> ir.Constant:
        return ir.Constant(ty, float(v))

    name = act.name
    if name == "sigmoid":
        return vecmath.sigmoid(b, x)
    if name == "tanh":
        return vecmath.tanh(b, x)
    if name == "relu":
        return b.select(b.fcmp_ordered("<", x, c(0.0)), c(0.0), x)
    if name == "affine":
        return b.fadd(b.fmul(x, c(act.alpha)), c(act.beta))
    if name == "leakyrelu":
        return b.select(b.fcmp_ordered("<", x, c(0.0)), b.fmul(x, c(act.alpha)), x)
    if name == "thresholdedrelu":
        return b.select(b.fcmp_ordered(">", x, c(act.alpha)), x, c(0.0))
    if name == "scaledtanh":
        return b.fmul(c(act.alpha), vecmath.tanh(b, b.fmul(x, c(act.beta))))
    if name == "hardsigmoid":
        y = b.fadd(b.fmul(x, c(act.alpha)), c(act.beta))
        return k.fmin(k.fmax(y, c(0.0)), c(1.0))
    if name == "elu":
        em1 = b.fmul(c(act.alpha), vecmath.expm1(b, x))
        return b.select(b.fcmp_ordered("<", x, c(0.0)), em1, x)
    if name == "softsign":
        return b.fdiv(x, b.fadd(c(1.0), k.intrinsic("llvm.fabs", [x])))
    if name == "softplus":
        return vecmath.softplus(b, x)
    raise AssertionError(name)


@dataclass
class _Geometry:
    """What `infer` and `lower` both derive from a node."""

    gates: int
    hidden: int
    dirs: int
    reverse: tuple[bool, ...]  # per direction
    layout: int
    seq: Dim
    batch: Dim
    input_size: Dim
    dtype: np.dtype
    acts: list[list[Activation]] = field(default_factory=list)  # per direction
    clip: float | None = None
    #: W and R are stored transposed for the GEMM kernel (see `_Recurrent._pack_weights`)
    packed: bool = False

    @property
    def width(self) -> int:
        """Gates x hidden: the width of one direction's projection."""
        return self.gates * self.hidden

    @property
    def proj_pitch(self) -> int:
        """Elements reserved per projection row (all directions), a multiple of 16."""
        return _round16(self.dirs * self.width)

    @property
    def state_pitch(self) -> int:
        """Elements reserved per batch row and direction for h (twice), c, gates and r*h."""
        return _round16(4 * self.hidden + self.width)

    def scratch_elements(self) -> Dim:
        # projection, its bias row, then per direction the h and c states, the gates, r*h
        # (GRU) and h's second buffer of each row. Every part is a multiple of 16 elements
        # (64 bytes and more), so the memory planner's 64-byte alignment of the size stays a
        # plain polynomial.
        return simplify_dim((self.seq * self.batch + 1) * self.proj_pitch
                            + self.dirs * self.batch * self.state_pitch)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


class _Recurrent(Op):
    """The shape rule and the shared lowering skeleton of LSTM, GRU and RNN."""

    since = 7
    dtypes = ("float32", "float64")
    gates: ClassVar[int]
    #: number of ONNX inputs
    n_inputs: ClassVar[int]
    default_acts: ClassVar[tuple[str, ...]]
    #: input index -> its role, for messages
    input_names: ClassVar[tuple[str, ...]]

    # -- shape rule ----------------------------------------------------------------------
    def _geometry(self, node: Node, ctx: InferContext) -> _Geometry:  # noqa: C901  (older than the rule: to split)
        self.check_dtypes(node)
        x, w, r = node.input(0), node.input(1), node.input(2)
        if x is None or w is None or r is None:
            raise ModelError(f"{node.describe()}: inputs X, W and R are required")
        packed = bool(node.attrs.get(_PACKED, 0))
        for v, want in ((x, 3), (w, 2 if packed else 3), (r, 2 if packed else 3)):
            if v.type.rank != want:
                raise ModelError(f"{node.describe()}: input {v.name!r} must have rank {want}, "
                                 f"got {v.type}")
        for operand in (w, r):
            if operand.type.dtype != x.type.dtype:
                raise ModelError(f"{node.describe()}: {operand.name!r} has dtype {operand.type.dtype.name}, "
                                 f"X has {x.type.dtype.name}; they must match")
        # explicit: GRU-1 spells its default "foward"
        direction = attr(node, "direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ModelError(f"{node.describe()}: direction {direction!r} must be forward, reverse "
                             "or bidirectional")
        dirs = 2 if direction == "bidirectional" else 1
        reverse = (False, True) if dirs == 2 else (direction == "reverse",)
        layout = int(attr(node, "layout"))
        if layout not in (0, 1):
            raise ModelError(f"{node.describe()}: layout {layout} must be 0 or 1")
        seq, batch, input_size = x.type.shape if layout == 0 else (
            x.type.shape[1], x.type.shape[0], x.type.shape[2])

        w_shape, r_shape = w.type.shape, r.type.shape
        hidden_attr = attr(node, "hidden_size")
        if packed:  # back to ONNX's [dirs, gates*hidden, input] and [dirs, gates*hidden, hidden]
            # (packing sets hidden_size)
            w_shape = (dirs, simplify_dim(w_shape[1] // dirs), w_shape[0])
            hid = int(node.attrs["hidden_size"])
            if tuple(r_shape) != (dirs * self.gates * packed_rows(hid, hid), PANEL):
                raise ModelError(f"{node.describe()}: packed R has shape {r.type}; expected "
                                 f"[{dirs * self.gates * packed_rows(hid, hid)}, {PANEL}]")
            r_shape = (dirs, self.gates * hid, hid)
        r_hidden = r_shape[2]
        if hidden_attr is not None:
            hidden = int(hidden_attr)
        elif isinstance(r_hidden, int):
            hidden = r_hidden
        else:
            raise UnsupportedOpError(f"{node.describe()}: the hidden size is not known at compile "
                                     "time; give the hidden_size attribute or a static R shape")
        if hidden <= 0:
            raise ModelError(f"{node.describe()}: hidden_size must be positive, got {hidden}")
        g = self.gates * hidden
        ctx.dims_equal(node, w_shape[0], dirs, f"W's dim 0 (directions for {direction})")
        ctx.dims_equal(node, w_shape[1], g, f"W's dim 1 ({self.gates} x hidden_size)")
        ctx.dims_equal(node, w_shape[2], input_size, "W's dim 2 (X's input size)")
        ctx.dims_equal(node, r_shape[0], dirs, "R's dim 0 (directions)")
        ctx.dims_equal(node, r_shape[1], g, f"R's dim 1 ({self.gates} x hidden_size)")
        ctx.dims_equal(node, r_hidden, hidden, "R's dim 2 (hidden_size)")

        state_shape = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
        expected: dict[int, tuple[Dim, ...]] = {3: (dirs, 2 * g), 4: (batch,), 5: state_shape}
        if self.n_inputs > 6:
            expected[6] = state_shape
            expected[7] = (dirs, 3 * hidden)
        for i, shape in expected.items():
            opt = node.input(i)
            if opt is None:
                continue
            if i == 4:
                if opt.type.dtype.kind not in "iu":
                    raise ModelError(f"{node.describe()}: sequence_lens must be int32, got "
                                     f"{opt.type.dtype.name}")
            elif opt.type.dtype != x.type.dtype:
                raise ModelError(f"{node.describe()}: {self.input_names[i]} ({opt.name!r}) has dtype "
                                 f"{opt.type.dtype.name}; expected {x.type.dtype.name}")
            if opt.type.rank != len(shape):
                raise ModelError(f"{node.describe()}: {self.input_names[i]} ({opt.name!r}) must have "
                                 f"shape {[str(d) for d in shape]}, got {opt.type}")
            for axis, (have, want) in enumerate(zip(opt.type.shape, shape)):
                ctx.dims_equal(node, have, want, f"{self.input_names[i]} dim {axis}")
        lens = node.input(4)
        if lens is not None and lens.const is not None and isinstance(seq, int):
            bad = (lens.const < 0) | (lens.const > seq)
            if bad.any():
                raise ModelError(f"{node.describe()}: sequence_lens {lens.const.tolist()} must lie "
                                 f"in [0, {seq}] (the sequence length)")

        clip = attr(node, "clip")
        geo = _Geometry(self.gates, hidden, dirs, reverse, layout, seq, batch, input_size,
                        x.type.dtype, clip=None if clip is None else float(clip), packed=packed)
        if geo.clip is not None and not geo.clip > 0:
            raise ModelError(f"{node.describe()}: clip must be positive, got {geo.clip}")
        geo.acts = self._activations(node, dirs)
        self._check_attrs(node)
        return geo

    def _check_attrs(self, node: Node) -> None:
        pass

    def _activations(self, node: Node, dirs: int) -> list[list[Activation]]:
        per = len(self.default_acts)
        names = node.attrs.get("activations")
        if names is None:
            names = list(self.default_acts) * dirs
        names = [str(n) for n in names]
        if len(names) == per and dirs == 2:
            names = names * 2
        if len(names) != per * dirs:
            raise ModelError(f"{node.describe()}: activations {names} must list {per * dirs} "
                             f"functions ({per} per direction, forward first)")
        alphas = [float(a) for a in node.attrs.get("activation_alpha", [])]
        betas = [float(a) for a in node.attrs.get("activation_beta", [])]
        out: list[Activation] = []
        for name in names:
            key = name.lower()
            if key not in _ACTIVATIONS:
                raise UnsupportedOpError(
                    f"{node.describe()}: activation {name!r} is not one cuvil knows; use one of "
                    "Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, "
                    "HardSigmoid, Elu, Softsign, Softplus")
            takes_a, takes_b, alpha, beta = _ACTIVATIONS[key]
            if takes_a and alphas:
                alpha = alphas.pop(0)
            if takes_b and betas:
                beta = betas.pop(0)
            out.append(Activation(key, alpha, beta))
        return [out[d * per:(d + 1) * per] for d in range(dirs)]

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        geo = self._geometry(node, ctx)
        self._pack_weights(node, ctx, geo)
        s, n, d, h = geo.seq, geo.batch, geo.dirs, geo.hidden
        y = (s, d, n, h) if geo.layout == 0 else (n, s, d, h)
        state = (d, n, h) if geo.layout == 0 else (n, d, h)
        outs = [TensorType(geo.dtype, y), TensorType(geo.dtype, state)]
        if self.n_inputs > 6:
            outs.append(TensorType(geo.dtype, state))
        return outs

    def _pack_weights(self, node: Node, ctx: InferContext, geo: _Geometry) -> None:
        """Constant float32 W and R become W^T [input, dirs*gates*hidden] (the layout of B in
        the shared GEMM kernel) and, for each direction and gate, R^T's [hidden, hidden] block
        in the panels of `_recurrent_kernel` (`_Lowering.gate_panels` finds one)."""
        w, r = node.inputs[1], node.inputs[2]
        if geo.packed or geo.dtype != np.float32 or w is None or r is None \
                or w.const is None or r.const is None:
            return
        graph = ctx.graph
        wt = np.ascontiguousarray(w.const.transpose(2, 0, 1).reshape(w.const.shape[2], -1))
        h = geo.hidden
        rt = np.concatenate([pack_panels(r.const[d, q * h:(q + 1) * h].T)
                             for d in range(geo.dirs) for q in range(geo.gates)])
        for i, (old, arr) in enumerate(((w, wt), (r, rt)), start=1):
            # the node is not in a graph yet (the importer adds it after `infer`): no users
            node.inputs[i] = graph.constant(arr, f"{old.name}_packed")
        node.attrs = {**node.attrs, _PACKED: 1, "hidden_size": h}

    # -- lowering ------------------------------------------------------------------------
    def scratch_bytes(self, node: Node) -> Dim:
        geo = self._geometry(node, UNCHECKED)
        return simplify_dim(geo.scratch_elements() * geo.dtype.itemsize)

    def lower(self, node: Node, k: Emitter) -> None:
        geo = self._geometry(node, UNCHECKED)
        # a big loop nest called once: inlining it into the run function gains nothing and
        # makes LLVM's function passes work on one huge function (slow compiles)
        if "noinline" not in k.function.attributes:
            k.function.attributes.add("noinline")
        assert k.scratch is not None
        _Lowering(self, node, k, geo, k.scratch).emit()

    def recurrent_bias_apart(self, node: Node) -> bool:
        """True when Rb of the last gate is applied inside the recurrence, not projected."""
        return False

    def phases(self, node: Node) -> list[_Phase]:
        """One time step, as the parts that follow each other (GRU's r*h needs every unit's
        r before its candidate's product)."""
        raise NotImplementedError


#: the gate math of one unit: (lowering, batch row b, its projection row, unit j)
UnitMath = Callable[["_Lowering", ir.Value, ir.Value, ir.Value], None]


@dataclass(frozen=True)
class _Phase:
    """Part of a time step: the gate sums of gates first..first+count-1, `vec` @ their R^T
    (`vec` is "h", or "aux": GRU's r*h), then `unit` for every active row and hidden unit.
    The last phase writes the next h (and Y); an ended row keeps its h there. An earlier phase
    writes aux, zero for an ended row (its products are not used, but stay finite)."""

    vec: str
    first: int
    count: int
    unit: UnitMath
    last: bool = True


def _dot_function(k: Emitter, dtype: np.dtype) -> ir.Function:
    """The module's one dot-product function for `dtype` (vectorized once, called by every
    recurrent node: inlining a vectorized loop at each call site made compiles slow)."""
    name = f"cuvil.recurrent_dot.{dtype.name}"
    if name in k.module.globals:
        return k.module.globals[name]
    ty = llvm_type(dtype)
    fn = ir.Function(k.module, ir.FunctionType(ty, [PTR, PTR, I64, ty]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    a, b, n, init = fn.args
    inner = Emitter(k.module, fn, ir.Constant(PTR, None), [], {}, k.target)
    slot = inner.b.alloca(ty)
    inner.b.store(init, slot)
    with inner.loop(n, name="dot") as i:
        pa = inner.b.gep(a, [i], source_etype=ty, inbounds=True)
        pb = inner.b.gep(b, [i], source_etype=ty, inbounds=True)
        acc = inner.b.load(slot, typ=ty)
        inner.b.store(inner.fmul_add(inner.b.load(pa, typ=ty), inner.b.load(pb, typ=ty), acc), slot)
    inner.b.ret(inner.b.load(slot, typ=ty))
    return fn


class _Lowering:
    """The code of one recurrent node: the projection, then per direction the recurrence.

    Scratch (in elements): ``proj[seq*batch, dirs*g]`` (rows in X's order), ``bias[dirs*g]``,
    then per direction (so that the two directions can run on two threads) the h and c states
    ``[batch, hidden]``, gate sums ``gates[batch, g]``, ``aux[batch, hidden]`` (GRU's r*h) and
    h's second buffer, with g = gates x hidden. An instance's state pointers are those of
    direction `d`; `at_step` picks which h buffer a step reads (`h_in`) and writes (`h_out`).
    """

    def __init__(self, op: _Recurrent, node: Node, k: Emitter, geo: _Geometry, base: ir.Value,
                 d: int = 0) -> None:
        self.op, self.node, self.k, self.geo, self.base, self.d = op, node, k, geo, base, d
        self.dtype = geo.dtype
        self.ty = llvm_type(geo.dtype)
        # the dims as LLVM values, once (lowering a symbolic dim costs sympy work each time)
        self.seq, self.batch, self.input_size = (k.dim(geo.seq), k.dim(geo.batch),
                                                 k.dim(geo.input_size))
        h = geo.hidden
        self.proj = base
        self.bias_row = self._ptr(base, self.mul(self.mul(self.seq, self.batch), geo.proj_pitch))
        states = self._ptr(self.bias_row, geo.proj_pitch)
        self.h_state = self._ptr(states, self.mul(self.batch, d * geo.state_pitch))
        self.c_state = self._ptr(self.h_state, self.mul(self.batch, h))
        self.gates = self._ptr(self.c_state, self.mul(self.batch, h))
        self.aux = self._ptr(self.gates, self.mul(self.batch, geo.width))
        self.h_second = self._ptr(self.aux, self.mul(self.batch, h))
        self.h_in, self.h_out = self.h_state, self.h_second

    def at_step(self, s: ir.Value) -> None:
        """Step s reads h from the first buffer when s is even, and writes the other."""
        odd = self.k.b.trunc(s, ir.IntType(1))
        self.h_in = self.k.b.select(odd, self.h_second, self.h_state)
        self.h_out = self.k.b.select(odd, self.h_state, self.h_second)

    # -- small helpers -------------------------------------------------------------------
    def _ptr(self, base: ir.Value, index: ir.Value | int) -> ir.Value:
        index = self.k.i64(index) if isinstance(index, int) else index
        return self.k.b.gep(base, [index], source_etype=self.ty, inbounds=True)

    def ld(self, base: ir.Value, index: ir.Value | int) -> ir.Value:
        return self.k.b.load(self._ptr(base, index), typ=self.ty)

    def st(self, base: ir.Value, index: ir.Value | int, value: ir.Value) -> None:
        self.k.b.store(value, self._ptr(base, index))

    def c(self, v: float) -> ir.Constant:
        return ir.Constant(self.ty, float(v))

    def add(self, a: ir.Value, b: ir.Value | int) -> ir.Value:
        return self.k.b.add(a, self.k.i64(b) if isinstance(b, int) else b)

    def mul(self, a: ir.Value, b: ir.Value | int) -> ir.Value:
        return self.k.b.mul(a, self.k.i64(b) if isinstance(b, int) else b)

    def input_ptr(self, i: int) -> ir.Value | None:
        v = self.node.input(i)
        return None if v is None else self.k.buffers[v]

    def output_ptr(self, i: int) -> ir.Value | None:
        return self.k.buffers[self.node.outputs[i]] if i < len(self.node.outputs) else None

    def activate(self, d: int, which: int, x: ir.Value, clip: bool = True) -> ir.Value:
        """Activation `which` of direction d; `clip` bounds its input (all but LSTM's h)."""
        if clip and self.geo.clip is not None:
            x = self.k.fmin(self.k.fmax(x, self.c(-self.geo.clip)), self.c(self.geo.clip))
        return emit_activation(self.k, self.geo.acts[d][which], x)

    def row_of(self, base: ir.Value, b: ir.Value, width: int) -> ir.Value:
        """Pointer to row b of a [batch, width] scratch array."""
        return self._ptr(base, self.mul(b, width))

    # -- indexing ------------------------------------------------------------------------
    def state_index(self, d: int, b: ir.Value) -> ir.Value:
        """Element offset of row b of direction d in a [dirs, batch, hidden] (layout 0) or
        [batch, dirs, hidden] (layout 1) tensor."""
        geo, k = self.geo, self.k
        if geo.layout == 0:
            outer = self.add(self.mul(k.i64(d), self.batch), b)
        else:
            outer = self.add(self.mul(b, geo.dirs), d)
        return self.mul(outer, geo.hidden)

    def y_index(self, d: int, t: ir.Value, b: ir.Value) -> ir.Value:
        """Element offset of Y[t, d, b, :] (layout 0) or Y[b, t, d, :] (layout 1)."""
        geo = self.geo
        if geo.layout == 0:
            outer = self.add(self.mul(self.add(self.mul(t, geo.dirs), d), self.batch), b)
        else:
            outer = self.add(self.mul(self.add(self.mul(b, self.seq), t), geo.dirs), d)
        return self.mul(outer, geo.hidden)

    def x_row(self, t: ir.Value, b: ir.Value) -> ir.Value:
        """Row of X (and of the projection) holding step t of batch row b."""
        geo = self.geo
        if geo.layout == 0:
            return self.add(self.mul(t, self.batch), b)
        return self.add(self.mul(b, self.seq), t)

    def seq_len(self, b: ir.Value) -> ir.Value:
        lens = self.node.input(4)
        if lens is None:
            return self.seq
        ty = llvm_type(lens.type.dtype)
        p = self.k.b.gep(self.k.buffers[lens], [b], source_etype=ty, inbounds=True)
        return self.k.convert(self.k.b.load(p, typ=ty), lens.type.dtype, np.dtype(np.int64))

    # -- the node ------------------------------------------------------------------------
    def emit(self) -> None:
        k, geo = self.k, self.geo
        if self.node.input(4) is not None:
            with k.loop(self.batch, name="lens") as b:
                n = self.seq_len(b)
                k.fail_if(k.b.or_(k.b.icmp_signed("<", n, k.i64(0)),
                                  k.b.icmp_signed(">", n, self.seq)))
        self.project()
        if geo.dirs == 1:
            self.direction(0)
            return
        # the directions share nothing but the projection: one thread each
        cost = self.mul(self.mul(self.seq, self.batch), geo.width * (geo.hidden + 8))
        with k.parallel_loop(2, cost=cost, name="direction", carry=[self.proj]) as d, \
                k.b.if_else(k.b.icmp_signed("==", d, k.i64(0))) as (forward, backward):
            base = k.carried[0]
            with forward:
                _Lowering(self.op, self.node, k, geo, base, 0).direction(0)
            with backward:
                _Lowering(self.op, self.node, k, geo, base, 1).direction(1)

    def direction(self, d: int) -> None:
        self.init_states(d)
        phases = self.op.phases(self.node)
        with self.k.loop(self.seq, name="step") as s:
            for phase in phases:
                self.run_phase(s, phase)
        self.at_step(self.seq)  # the buffer the last step wrote
        self.final_states(d)

    def run_phase(self, s: ir.Value, phase: _Phase) -> None:
        """One phase of step s: on one thread, or (packed weights) a parallel loop over blocks
        of hidden units, one block per thread that the loop gets (a call per gate and block:
        more blocks would only add calls), each doing its units' products and then their gate
        math."""
        k, geo = self.k, self.geo
        b = k.b
        h = geo.hidden
        if not geo.packed:
            self.at_step(s)
            self.products(self.vec(phase), phase.first * h, phase.count * h)
            self.rows(s, k.i64(0), k.i64(h), phase)
            return
        panels = k.i64(-(-h // PANEL))
        blocks = k.minimum("int64", panels, self.k.parallel_threads())
        per_block = k.floordiv(b.add(panels, b.sub(blocks, k.i64(1))), blocks)  # panels
        blocks = k.floordiv(b.add(panels, b.sub(per_block, k.i64(1))), per_block)
        # the products and the gate math of a panel's units
        cost = b.mul(k.dim(simplify_dim(geo.batch * PANEL * (h * phase.count + 32))), per_block)
        with k.parallel_loop(blocks, cost=cost, name="units",
                             carry=[self.base, s, per_block]) as u:
            low = _Lowering(self.op, self.node, k, geo, k.carried[0], self.d)
            step, width = k.carried[1], low.mul(k.carried[2], PANEL)
            low.at_step(step)
            j0 = k.b.mul(u, width)
            count = k.minimum("int64", width, k.b.sub(k.i64(h), j0))
            for q in range(phase.first, phase.first + phase.count):
                low.panel_product(low.vec(phase), q, j0, count)
            low.rows(step, j0, count, phase)

    def vec(self, phase: _Phase) -> ir.Value:
        return self.h_in if phase.vec == "h" else self.aux

    def project(self) -> None:
        """proj[row, d*g + j] = X[row] . W[d, j] + bias(d, j) for every row of X."""
        k, geo = self.k, self.geo
        g = geo.width
        x, w, bias = self.input_ptr(0), self.input_ptr(1), self.input_ptr(3)
        assert x is not None and w is not None
        rows = self.mul(self.seq, self.batch)
        width = k.i64(geo.dirs * g)
        isize = self.input_size
        if bias is not None:
            # Wb + Rb per column; GRU with linear_before_reset keeps its candidate's Rb apart
            apart = self.op.recurrent_bias_apart(self.node)
            with k.loop(width, name="bias") as col:
                d = k.b.sdiv(col, k.i64(g))
                j = k.b.srem(col, k.i64(g))
                base = self.mul(d, 2 * g)
                wb = self.ld(bias, self.add(base, j))
                both = k.b.fadd(wb, self.ld(bias, self.add(self.add(base, g), j)))
                if apart:
                    both = k.b.select(k.b.icmp_signed(">=", j, k.i64(2 * geo.hidden)), wb, both)
                self.st(self.bias_row, col, both)
        if geo.packed:
            emit_parallel_gemm(k, rows, width, isize, x, isize, w, width, self.proj, width,
                               bias=self.bias_row if bias is not None else None,
                               epilogue=Epilogue(bias="col" if bias is not None else "none"))
            return
        with k.loop(rows, name="row") as r:
            xrow = self._ptr(x, self.mul(r, isize))
            prow = self._ptr(self.proj, self.mul(r, width))
            with k.loop(width, name="col") as col:
                init = self.ld(self.bias_row, col) if bias is not None else self.c(0.0)
                self.st(prow, col, self.dot(xrow, self._ptr(w, self.mul(col, isize)), isize, init))

    def gate_panels(self, d: int, q: int) -> ir.Value:
        """Direction d's packed R^T block of gate q (`_Recurrent._pack_weights`)."""
        r = self.input_ptr(2)
        assert r is not None
        h = self.geo.hidden
        return self._ptr(r, (d * self.geo.gates + q) * packed_rows(h, h) * PANEL)

    def dot(self, a: ir.Value, b: ir.Value, n: ir.Value, init: ir.Value) -> ir.Value:
        """init + sum(a[i] * b[i] for i < n), reassociated so it vectorizes."""
        return self.k.b.call(_dot_function(self.k, self.dtype), [a, b, n, init])

    def panel_product(self, vec: ir.Value, q: int, j0: ir.Value, cols: ir.Value) -> None:
        """gates[b, q*h + j0 : +cols] = vec[b] @ R[d, gate q, units j0..]^T for every row b, from
        the packed panels of those units (j0 a multiple of PANEL): whole row tiles on the GEMM
        kernel for many rows, a panel at a time (it reads one as a [h, PANEL] matrix), the few
        rows left on the small-M kernel."""
        k, geo = self.k, self.geo
        b = k.b
        g, h = geo.width, geo.hidden
        mr = k.target.isa.mr
        full = self.mul(k.floordiv(self.batch, k.i64(mr)), mr)
        panel = self._ptr(self.gate_panels(self.d, q), self.mul(j0, h))
        out = self._ptr(self.gates, self.add(j0, q * h))
        with k.if_then(b.icmp_signed(">", full, k.i64(0))):
            count = k.floordiv(b.add(cols, k.i64(PANEL - 1)), k.i64(PANEL))
            with k.loop(count, name="panel") as p:
                jp = self.mul(p, PANEL)
                emit_gemm(k, full, k.minimum("int64", k.i64(PANEL), b.sub(cols, jp)), k.i64(h),
                          vec, k.i64(h), self._ptr(panel, self.mul(jp, h)), k.i64(PANEL),
                          self._ptr(out, jp), k.i64(g))
        emit_small_gemm(k, k.b.sub(self.batch, full), cols, k.i64(h),
                        self._ptr(vec, self.mul(full, h)), k.i64(h), panel,
                        self._ptr(out, self.mul(full, g)), k.i64(g))

    def products(self, vec: ir.Value, first: int, count: int) -> None:
        """gates[b, first:first+count] = vec[b] @ R[d, first:first+count]^T for every row b, by
        dot products (weights not packed)."""
        k, geo = self.k, self.geo
        g, h = geo.width, geo.hidden
        r = self.input_ptr(2)
        assert r is not None
        rd = self._ptr(r, self.d * g * h)
        with k.loop(self.batch, name="prod_b") as b:
            vrow = self.row_of(vec, b, h)
            grow = self.row_of(self.gates, b, g)
            with k.loop(first + count, start=first, name="prod_j") as j:
                self.st(grow, j, self.dot(self._ptr(rd, self.mul(j, h)), vrow, k.i64(h), self.c(0.0)))

    def rows(self, s: ir.Value, j0: ir.Value, count: ir.Value, phase: _Phase) -> None:
        """`phase.unit` for units j0..j0+count-1 of each batch row b whose sequence covers
        step s, with its projection row of direction d's current input; then the new h of
        those units copied into Y. A row whose sequence has ended keeps its h (zeros in Y
        with sequence_lens), or gets zero aux."""
        k, geo = self.k, self.geo
        h, d = geo.hidden, self.d
        end = k.b.add(j0, count)
        y = self.output_ptr(0) if phase.last else None
        has_lens = self.node.input(4) is not None
        with k.loop(self.batch, name="b") as b:
            n = self.seq_len(b)
            with k.b.if_else(k.b.icmp_signed("<", s, n)) as (then, otherwise):
                with then:
                    t = k.b.sub(k.b.sub(n, k.i64(1)), s) if geo.reverse[d] else s
                    row = self.x_row(t, b)
                    prow = self._ptr(self.proj, self.add(self.mul(row, geo.dirs * geo.width),
                                                         d * geo.width))
                    with k.loop(end, start=j0, name="unit") as j:
                        phase.unit(self, b, prow, j)
                    if y is not None:
                        yrow = self._ptr(y, self.y_index(d, t, b))
                        hrow = self.row_of(self.h_out, b, h)
                        with k.loop(end, start=j0, name="y") as j:
                            self.st(yrow, j, self.ld(hrow, j))
                with otherwise:
                    if phase.last:
                        src, dst = self.row_of(self.h_in, b, h), self.row_of(self.h_out, b, h)
                        with k.loop(end, start=j0, name="keep") as j:
                            self.st(dst, j, self.ld(src, j))
                    else:
                        arow = self.row_of(self.aux, b, h)
                        with k.loop(end, start=j0, name="aux0") as j:
                            self.st(arow, j, self.c(0.0))
                    if y is not None and has_lens:
                        yrow = self._ptr(y, self.y_index(d, s, b))
                        with k.loop(end, start=j0, name="y0") as j:
                            self.st(yrow, j, self.c(0.0))

    def init_states(self, d: int) -> None:
        k, h = self.k, self.geo.hidden
        states = [(self.input_ptr(5), self.h_state)]
        if self.op.n_inputs > 6:
            states.append((self.input_ptr(6), self.c_state))
        with k.loop(self.batch, name="init") as b:
            src = self.state_index(d, b)
            for init, state in states:
                dst = self.row_of(state, b, h)
                with k.loop(h, name="init_k") as j:
                    v = self.ld(init, self.add(src, j)) if init is not None else self.c(0.0)
                    self.st(dst, j, v)

    def final_states(self, d: int) -> None:
        k, h = self.k, self.geo.hidden
        for out_index, state in ((1, self.h_in), (2, self.c_state)):
            out = self.output_ptr(out_index)
            if out is None:
                continue
            with k.loop(self.batch, name="final") as b:
                # a row whose sequence is empty ends with zero states (onnxruntime's choice)
                empty = k.b.icmp_signed("==", self.seq_len(b), k.i64(0))
                dst = self._ptr(out, self.state_index(d, b))
                src = self.row_of(state, b, h)
                with k.loop(h, name="final_k") as j:
                    self.st(dst, j, k.b.select(empty, self.c(0.0), self.ld(src, j)))


@register
class RNN(_Recurrent):
    """Ht = f(Xt*W^T + Ht-1*R^T + Wb + Rb)."""

    op_type = "RNN"
    gates = 1
    n_inputs = 6
    default_acts = ("Tanh",)
    input_names = ("X", "W", "R", "B", "sequence_lens", "initial_h")

    def phases(self, node: Node) -> list[_Phase]:
        def unit(low: _Lowering, b: ir.Value, prow: ir.Value, j: ir.Value) -> None:
            hid = low.geo.hidden
            pre = low.k.b.fadd(low.ld(prow, j), low.ld(low.row_of(low.gates, b, hid), j))
            low.st(low.row_of(low.h_out, b, hid), j, low.activate(low.d, 0, pre))

        return [_Phase("h", 0, 1, unit)]


@register
class GRU(_Recurrent):
    """Gates z, r, h (in W, R and B in that order); linear_before_reset picks where r applies:
    h~ = g(Xt*Wh^T + (r * Ht-1)*Rh^T + Rbh + Wbh) (0) or g(Xt*Wh^T + r * (Ht-1*Rh^T + Rbh) +
    Wbh) (1); Ht = (1 - z) * h~ + z * Ht-1."""

    op_type = "GRU"
    gates = 3
    n_inputs = 6
    default_acts = ("Sigmoid", "Tanh")
    input_names = ("X", "W", "R", "B", "sequence_lens", "initial_h")

    def recurrent_bias_apart(self, node: Node) -> bool:
        return bool(attr(node, "linear_before_reset"))

    def phases(self, node: Node) -> list[_Phase]:
        linear = self.recurrent_bias_apart(node)

        def gate(low: _Lowering, prow: ir.Value, b: ir.Value, j: ir.Value, index: int) -> ir.Value:
            jj = low.add(j, index * low.geo.hidden)
            return low.k.b.fadd(low.ld(prow, jj), low.ld(low.row_of(low.gates, b, low.geo.width), jj))

        def update(low: _Lowering, b: ir.Value, prow: ir.Value, j: ir.Value) -> None:
            fb, hid, d = low.k.b, low.geo.hidden, low.d
            z = low.activate(d, 0, gate(low, prow, b, j, 0))
            if linear:
                r = low.activate(d, 0, gate(low, prow, b, j, 1))
                jj = low.add(j, 2 * hid)
                rec = low.ld(low.row_of(low.gates, b, low.geo.width), jj)
                bias = low.input_ptr(3)
                if bias is not None:
                    rec = fb.fadd(rec, low.ld(bias, low.add(j, d * 6 * hid + 5 * hid)))
                pre = fb.fadd(low.ld(prow, jj), fb.fmul(r, rec))
            else:
                pre = gate(low, prow, b, j, 2)
            cand = low.activate(d, 1, pre)
            hv = low.ld(low.row_of(low.h_in, b, hid), j)
            low.st(low.row_of(low.h_out, b, hid), j,
                   fb.fadd(fb.fmul(fb.fsub(low.c(1.0), z), cand), fb.fmul(z, hv)))

        if linear:
            return [_Phase("h", 0, 3, update)]

        def reset(low: _Lowering, b: ir.Value, prow: ir.Value, j: ir.Value) -> None:
            hid = low.geo.hidden
            r = low.activate(low.d, 0, gate(low, prow, b, j, 1))
            low.st(low.row_of(low.aux, b, hid), j,
                   low.k.b.fmul(r, low.ld(low.row_of(low.h_in, b, hid), j)))

        # the candidate's product needs r*h of every unit: a phase of its own
        return [_Phase("h", 0, 2, reset, last=False), _Phase("aux", 2, 1, update)]


@register
class LSTM(_Recurrent):
    """Gates i, o, f, c (in W, R and B in that order), peepholes P = [Pi, Po, Pf]:
    i = f(.. + Pi*Ct-1), f = f(.. + Pf*Ct-1) (or 1 - i with input_forget), c~ = g(..),
    Ct = f*Ct-1 + i*c~, o = f(.. + Po*Ct), Ht = o*h(Ct)."""

    op_type = "LSTM"
    gates = 4
    n_inputs = 8
    default_acts = ("Sigmoid", "Tanh", "Tanh")
    input_names = ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")

    def _check_attrs(self, node: Node) -> None:
        if attr(node, "input_forget") not in (0, 1):
            raise ModelError(f"{node.describe()}: input_forget must be 0 or 1")

    def phases(self, node: Node) -> list[_Phase]:
        couple = bool(attr(node, "input_forget"))

        def unit(low: _Lowering, b: ir.Value, prow: ir.Value, j: ir.Value) -> None:
            fb, hid, d = low.k.b, low.geo.hidden, low.d
            grow, crow = low.row_of(low.gates, b, low.geo.width), low.row_of(low.c_state, b, hid)
            peep = low.input_ptr(7)

            def gate(index: int, cell: ir.Value | None) -> ir.Value:
                jj = low.add(j, index * hid)
                pre = fb.fadd(low.ld(prow, jj), low.ld(grow, jj))
                if peep is not None and cell is not None:
                    # P holds [Pi, Po, Pf]; the gate order is i=0, o=1, f=2
                    p = low.ld(peep, low.add(j, d * 3 * hid + index * hid))
                    pre = fb.fadd(pre, fb.fmul(p, cell))
                return pre

            c_prev = low.ld(crow, j)
            i = low.activate(d, 0, gate(0, c_prev))
            f = fb.fsub(low.c(1.0), i) if couple else low.activate(d, 0, gate(2, c_prev))
            cand = low.activate(d, 1, gate(3, None))
            c_new = fb.fadd(fb.fmul(f, c_prev), fb.fmul(i, cand))
            o = low.activate(d, 0, gate(1, c_new))
            low.st(crow, j, c_new)
            low.st(low.row_of(low.h_out, b, hid), j, fb.fmul(o, low.activate(d, 2, c_new, clip=False)))

        return [_Phase("h", 0, 4, unit)]
