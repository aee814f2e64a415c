"""Recurrent layers: LSTM, GRU and RNN (ONNX opsets 7, 14 and 22).

All three share one structure. The input projection of every step does not depend on the
recurrence, so it is one product up front: ``xproj[seq*batch, dirs*gates*hidden] = X @ W^T``
(biases folded in). Then, for each direction and step, each batch row adds its recurrent
product ``h @ R^T`` and applies the gate math in place on its state. Batch rows are
independent, which is what makes per-row sequence lengths simple: a row whose sequence has
ended keeps its state (so Y_h/Y_c hold its last valid step) and writes zeros into Y, as
onnxruntime does.

Scratch memory (the projection, the states and one row of gates) is a `cuvil.RecurrentScratch`
value that `infer` adds to the graph just before the node and appends to the node's inputs:
the memory planner then places it in the workspace for the node's lifetime.

Activation functions and their ``activation_alpha``/``activation_beta`` follow onnxruntime:
names are case-insensitive, the alpha (beta) list is consumed in order by the functions that
take an alpha (beta), and a missing value defaults to 0.01 (LeakyRelu), 0.2/0.5
(HardSigmoid), 1.0 (Elu), else 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from llvmlite import ir

from cuvil.compiler.codegen.emitter import I64, PTR, Emitter, llvm_type
from cuvil.compiler.ir import Dim, Node, TensorType, simplify_dim
from cuvil.compiler.ops import UNCHECKED, InferContext, Op, register
from cuvil.errors import ModelError, UnsupportedOpError

__all__ = ["GRU", "LSTM", "RNN", "RecurrentScratch"]

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
    """act(x) for a float scalar; exp-based functions cannot overflow into NaN."""
    b = k.b
    ty = x.type

    def c(v: float) -> ir.Constant:
        return ir.Constant(ty, float(v))

    name = act.name
    if name == "sigmoid":
        # 1/(1+e^-x): e^-x overflows to inf for very negative x, giving exactly 0
        return b.fdiv(c(1.0), b.fadd(c(1.0), k.intrinsic("llvm.exp", [b.fneg(x)])))
    if name == "tanh":
        return k.intrinsic("llvm.tanh", [x])
    if name == "relu":
        return b.select(b.fcmp_ordered("<", x, c(0.0)), c(0.0), x)
    if name == "affine":
        return b.fadd(b.fmul(x, c(act.alpha)), c(act.beta))
    if name == "leakyrelu":
        return b.select(b.fcmp_ordered("<", x, c(0.0)), b.fmul(x, c(act.alpha)), x)
    if name == "thresholdedrelu":
        return b.select(b.fcmp_ordered(">", x, c(act.alpha)), x, c(0.0))
    if name == "scaledtanh":
        return b.fmul(c(act.alpha), k.intrinsic("llvm.tanh", [b.fmul(x, c(act.beta))]))
    if name == "hardsigmoid":
        y = b.fadd(b.fmul(x, c(act.alpha)), c(act.beta))
        return k.fmin(k.fmax(y, c(0.0)), c(1.0))
    if name == "elu":
        em1 = b.fmul(c(act.alpha), b.fsub(k.intrinsic("llvm.exp", [x]), c(1.0)))
        return b.select(b.fcmp_ordered("<", x, c(0.0)), em1, x)
    if name == "softsign":
        return b.fdiv(x, b.fadd(c(1.0), k.intrinsic("llvm.fabs", [x])))
    if name == "softplus":
        # log(1 + e^x) = max(x, 0) + log1p(e^-|x|): no overflow for large x
        e = k.intrinsic("llvm.exp", [b.fneg(k.intrinsic("llvm.fabs", [x]))])
        pos = b.select(b.fcmp_ordered(">", x, c(0.0)), x, c(0.0))
        return b.fadd(pos, k.intrinsic("llvm.log", [b.fadd(c(1.0), e)]))
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

    def scratch_elements(self) -> Dim:
        g, h = self.gates * self.hidden, self.hidden
        # projection, its bias row, h and c states, one row of gates, one row of r*h (GRU)
        return simplify_dim((self.seq * self.batch + 1) * self.dirs * g + 2 * self.batch * h
                            + g + h)


class _Recurrent(Op):
    """The shape rule and the shared lowering skeleton of LSTM, GRU and RNN."""

    since = 7
    dtypes = ("float32", "float64")
    gates: ClassVar[int]
    #: number of ONNX inputs (the scratch value comes after them)
    n_inputs: ClassVar[int]
    default_acts: ClassVar[tuple[str, ...]]
    #: input index -> its role, for messages
    input_names: ClassVar[tuple[str, ...]]

    # -- shape rule ----------------------------------------------------------------------
    def _geometry(self, node: Node, ctx: InferContext) -> _Geometry:
        self.check_dtypes(node)
        x, w, r = node.input(0), node.input(1), node.input(2)
        if x is None or w is None or r is None:
            raise ModelError(f"{node.describe()}: inputs X, W and R are required")
        for v, want in ((x, 3), (w, 3), (r, 3)):
            if v.type.rank != want:
                raise ModelError(f"{node.describe()}: input {v.name!r} must have rank {want}, "
                                 f"got {v.type}")
        for v in (w, r):
            if v.type.dtype != x.type.dtype:
                raise ModelError(f"{node.describe()}: {v.name!r} has dtype {v.type.dtype.name}, "
                                 f"X has {x.type.dtype.name}; they must match")
        direction = node.attrs.get("direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ModelError(f"{node.describe()}: direction {direction!r} must be forward, reverse "
                             "or bidirectional")
        dirs = 2 if direction == "bidirectional" else 1
        reverse = (False, True) if dirs == 2 else (direction == "reverse",)
        layout = int(node.attrs.get("layout", 0))
        if layout not in (0, 1):
            raise ModelError(f"{node.describe()}: layout {layout} must be 0 or 1")
        seq, batch, input_size = x.type.shape if layout == 0 else (
            x.type.shape[1], x.type.shape[0], x.type.shape[2])

        hidden_attr = node.attrs.get("hidden_size")
        r_hidden = r.type.shape[2]
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
        ctx.dims_equal(node, w.type.shape[0], dirs, f"W's dim 0 (directions for {direction})")
        ctx.dims_equal(node, w.type.shape[1], g, f"W's dim 1 ({self.gates} x hidden_size)")
        ctx.dims_equal(node, w.type.shape[2], input_size, "W's dim 2 (X's input size)")
        ctx.dims_equal(node, r.type.shape[0], dirs, "R's dim 0 (directions)")
        ctx.dims_equal(node, r.type.shape[1], g, f"R's dim 1 ({self.gates} x hidden_size)")
        ctx.dims_equal(node, r_hidden, hidden, "R's dim 2 (hidden_size)")

        state_shape = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
        expected: dict[int, tuple[Dim, ...]] = {3: (dirs, 2 * g), 4: (batch,), 5: state_shape}
        if self.n_inputs > 6:
            expected[6] = state_shape
            expected[7] = (dirs, 3 * hidden)
        for i, shape in expected.items():
            v = node.input(i)
            if v is None:
                continue
            if i == 4:
                if v.type.dtype.kind not in "iu":
                    raise ModelError(f"{node.describe()}: sequence_lens must be int32, got "
                                     f"{v.type.dtype.name}")
            elif v.type.dtype != x.type.dtype:
                raise ModelError(f"{node.describe()}: {self.input_names[i]} ({v.name!r}) has dtype "
                                 f"{v.type.dtype.name}; expected {x.type.dtype.name}")
            if v.type.rank != len(shape):
                raise ModelError(f"{node.describe()}: {self.input_names[i]} ({v.name!r}) must have "
                                 f"shape {[str(d) for d in shape]}, got {v.type}")
            for axis, (have, want) in enumerate(zip(v.type.shape, shape)):
                ctx.dims_equal(node, have, want, f"{self.input_names[i]} dim {axis}")
        lens = node.input(4)
        if lens is not None and lens.const is not None and isinstance(seq, int):
            bad = (lens.const < 0) | (lens.const > seq)
            if bad.any():
                raise ModelError(f"{node.describe()}: sequence_lens {lens.const.tolist()} must lie "
                                 f"in [0, {seq}] (the sequence length)")

        clip = node.attrs.get("clip")
        geo = _Geometry(self.gates, hidden, dirs, reverse, layout, seq, batch, input_size,
                        x.type.dtype, clip=None if clip is None else float(clip))
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
        self._attach_scratch(node, ctx, geo)
        s, n, d, h = geo.seq, geo.batch, geo.dirs, geo.hidden
        y = (s, d, n, h) if geo.layout == 0 else (n, s, d, h)
        state = (d, n, h) if geo.layout == 0 else (n, d, h)
        outs = [TensorType(geo.dtype, y), TensorType(geo.dtype, state)]
        if self.n_inputs > 6:
            outs.append(TensorType(geo.dtype, state))
        return outs

    def _attach_scratch(self, node: Node, ctx: InferContext, geo: _Geometry) -> None:
        if len(node.inputs) > self.n_inputs:
            return  # already attached (infer ran before)
        graph = ctx.graph
        base = node.name or (node.outputs[0].name if node.outputs else node.op_type)
        value = graph.value(f"{base}_scratch", TensorType(geo.dtype, (geo.scratch_elements(),)))
        graph.add_node(Node("RecurrentScratch", [], [value], name=f"{base}_scratch",
                            domain="cuvil", opset=1))
        node.inputs = [*node.inputs, *[None] * (self.n_inputs - len(node.inputs)), value]

    # -- lowering ------------------------------------------------------------------------
    def lower(self, node: Node, k: Emitter) -> None:
        geo = self._geometry(node, UNCHECKED)
        # a big loop nest called once: inlining it into the run function gains nothing and
        # makes LLVM's function passes work on one huge function (slow compiles)
        if "noinline" not in k.function.attributes:
            k.function.attributes.add("noinline")
        _Lowering(self, node, k, geo).emit()

    def recurrent_bias_apart(self, node: Node) -> bool:
        """True when Rb of the last gate is applied inside the recurrence, not projected."""
        return False

    def step(self, low: _Lowering, d: int, b: ir.Value, row: ir.Value) -> None:
        """Update the states of batch row `b` from the projection row `row` (direction d)."""
        raise NotImplementedError


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
    inner = Emitter(k.module, fn, ir.Constant(PTR, None), [], {})
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
    """The code of one recurrent node: the projection, then per direction the recurrence."""

    def __init__(self, op: _Recurrent, node: Node, k: Emitter, geo: _Geometry) -> None:
        self.op, self.node, self.k, self.geo = op, node, k, geo
        self.dtype = geo.dtype
        self.ty = llvm_type(geo.dtype)
        scratch = node.inputs[op.n_inputs]
        assert scratch is not None
        s, n, d, g, h = geo.seq, geo.batch, geo.dirs, geo.gates * geo.hidden, geo.hidden
        base = k.buffers[scratch]
        self.proj = base  # [seq*batch rows in X's order, dirs*g]
        self.bias_row = self._ptr(base, k.dim(simplify_dim(s * n * d * g)))  # [dirs*g]
        offset: Dim = (s * n + 1) * d * g
        self.h_state = self._ptr(base, k.dim(simplify_dim(offset)))  # [batch, hidden]
        self.c_state = self._ptr(base, k.dim(simplify_dim(offset + n * h)))  # [batch, hidden]
        self.gate_row = self._ptr(base, k.dim(simplify_dim(offset + 2 * n * h)))  # [g]
        self.aux_row = self._ptr(base, k.dim(simplify_dim(offset + 2 * n * h + g)))  # [hidden]

    # -- small helpers -------------------------------------------------------------------
    def _ptr(self, base: ir.Value, index: ir.Value) -> ir.Value:
        return self.k.b.gep(base, [index], source_etype=self.ty, inbounds=True)

    def ld(self, base: ir.Value, index: ir.Value) -> ir.Value:
        return self.k.b.load(self._ptr(base, index), typ=self.ty)

    def st(self, base: ir.Value, index: ir.Value, value: ir.Value) -> None:
        self.k.b.store(value, self._ptr(base, index))

    def c(self, v: float) -> ir.Constant:
        return ir.Constant(self.ty, float(v))

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.b.add(a, b)

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.b.mul(a, b)

    def input_ptr(self, i: int) -> ir.Value | None:
        v = self.node.input(i)
        return None if v is None else self.k.buffers[v]

    def output_ptr(self, i: int) -> ir.Value | None:
        return self.k.buffers[self.node.outputs[i]] if i < len(self.node.outputs) else None

    def acc_slot(self) -> ir.Value:
        """A stack slot in the entry block (LLVM turns it into a register)."""
        b = self.k.b
        with b.goto_entry_block():
            if b.block.terminator is not None:
                b.position_before(b.block.terminator)
            return b.alloca(self.ty)

    def activate(self, d: int, which: int, x: ir.Value, clip: bool = True) -> ir.Value:
        """Activation `which` of direction d; `clip` bounds its input (all but LSTM's h)."""
        if clip and self.geo.clip is not None:
            x = self.k.fmin(self.k.fmax(x, self.c(-self.geo.clip)), self.c(self.geo.clip))
        return emit_activation(self.k, self.geo.acts[d][which], x)

    def dot(self, a: ir.Value, b: ir.Value, n: ir.Value | int, init: ir.Value) -> ir.Value:
        """init + sum(a[i] * b[i] for i < n), reassociated so it vectorizes."""
        fn = _dot_function(self.k, self.dtype)
        return self.k.b.call(fn, [a, b, self.k.dim(n), init])

    def state_index(self, d: int, b: ir.Value) -> ir.Value:
        """Element offset of row b of direction d in a [dirs, batch, hidden] (layout 0) or
        [batch, dirs, hidden] (layout 1) tensor."""
        geo, k = self.geo, self.k
        if geo.layout == 0:
            outer = self.add(self.mul(k.i64(d), k.dim(geo.batch)), b)
        else:
            outer = self.add(self.mul(b, k.i64(geo.dirs)), k.i64(d))
        return self.mul(outer, k.i64(geo.hidden))

    def y_index(self, d: int, t: ir.Value, b: ir.Value) -> ir.Value:
        """Element offset of Y[t, d, b, :] (layout 0) or Y[b, t, d, :] (layout 1)."""
        geo, k = self.geo, self.k
        dd, h = k.i64(geo.dirs), k.i64(geo.hidden)
        if geo.layout == 0:
            outer = self.add(self.mul(self.add(self.mul(t, dd), k.i64(d)), k.dim(geo.batch)), b)
        else:
            outer = self.add(self.mul(self.add(self.mul(b, k.dim(geo.seq)), t), dd), k.i64(d))
        return self.mul(outer, h)

    def x_row(self, t: ir.Value, b: ir.Value) -> ir.Value:
        """Row of X (and of the projection) holding step t of batch row b."""
        geo = self.geo
        if geo.layout == 0:
            return self.add(self.mul(t, self.k.dim(geo.batch)), b)
        return self.add(self.mul(b, self.k.dim(geo.seq)), t)

    # -- the node ------------------------------------------------------------------------
    def emit(self) -> None:
        k, geo = self.k, self.geo
        lens = self.node.input(4)
        if lens is not None:
            with k.loop(geo.batch, name="lens") as b:
                n = self.seq_len(b)
                bad = k.b.or_(k.b.icmp_signed("<", n, k.i64(0)),
                              k.b.icmp_signed(">", n, k.dim(geo.seq)))
                k.fail_if(bad)
        self.project()
        for d in range(geo.dirs):
            self.direction(d)

    def seq_len(self, b: ir.Value) -> ir.Value:
        lens = self.node.input(4)
        if lens is None:
            return self.k.dim(self.geo.seq)
        p = self.k.b.gep(self.k.buffers[lens], [b], source_etype=llvm_type(lens.type.dtype),
                         inbounds=True)
        v = self.k.b.load(p, typ=llvm_type(lens.type.dtype))
        return self.k.convert(v, lens.type.dtype, np.int64)

    def project(self) -> None:
        """proj[row, d*g + j] = X[row] . W[d, j] + bias(d, j) for every row of X."""
        k, geo, op = self.k, self.geo, self.op
        g = geo.gates * geo.hidden
        x, w = self.input_ptr(0), self.input_ptr(1)
        bias = self.input_ptr(3)
        assert x is not None and w is not None
        rows = k.dim(simplify_dim(geo.seq * geo.batch))
        width = k.i64(geo.dirs * g)
        isize = k.dim(geo.input_size)
        # the bias of each projected column, once: Wb + Rb (GRU with linear_before_reset keeps
        # Rb of its candidate gate for the recurrent part)
        if bias is not None:
            with k.loop(width, name="bias") as col:
                d = k.b.sdiv(col, k.i64(g))
                j = k.b.srem(col, k.i64(g))
                base = self.mul(d, k.i64(2 * g))
                wb = self.ld(bias, self.add(base, j))
                rb = self.ld(bias, self.add(self.add(base, k.i64(g)), j))
                both = k.b.fadd(wb, rb)
                if op.recurrent_bias_apart(self.node):
                    keep = k.b.icmp_signed(">=", j, k.i64(2 * geo.hidden))
                    both = k.b.select(keep, wb, both)
                self.st(self.bias_row, col, both)
        with k.loop(rows, name="row") as r:
            xrow = self._ptr(x, self.mul(r, isize))
            prow = self._ptr(self.proj, self.mul(r, width))
            with k.loop(width, name="col") as col:
                init = self.ld(self.bias_row, col) if bias is not None else self.c(0.0)
                wrow = self._ptr(w, self.mul(col, isize))
                self.st(prow, col, self.dot(xrow, wrow, isize, init))

    def direction(self, d: int) -> None:
        k, geo = self.k, self.geo
        h = k.i64(geo.hidden)
        init_h, init_c = self.input_ptr(5), self.input_ptr(6) if self.op.n_inputs > 6 else None
        with k.loop(geo.batch, name="init") as b:
            src = self.state_index(d, b)
            dst = self.mul(b, h)
            with k.loop(h, name="init_k") as j:
                hv = self.ld(init_h, self.add(src, j)) if init_h is not None else self.c(0.0)
                self.st(self.h_state, self.add(dst, j), hv)
                if self.op.n_inputs > 6:
                    cv = self.ld(init_c, self.add(src, j)) if init_c is not None else self.c(0.0)
                    self.st(self.c_state, self.add(dst, j), cv)
        y = self.output_ptr(0)
        has_lens = self.node.input(4) is not None
        with k.loop(geo.seq, name="step") as s, k.loop(geo.batch, name="b") as b:
            n = self.seq_len(b)
            active = k.b.icmp_signed("<", s, n)
            with k.b.if_else(active) as (then, otherwise):
                with then:
                    t = k.b.sub(k.b.sub(n, k.i64(1)), s) if geo.reverse[d] else s
                    self.op.step(self, d, b, self.x_row(t, b))
                    if y is not None:
                        yi = self.y_index(d, t, b)
                        hi = self.mul(b, h)
                        with k.loop(h, name="y") as j:
                            self.st(y, self.add(yi, j), self.ld(self.h_state, self.add(hi, j)))
                with otherwise:
                    if y is not None and has_lens:
                        yi = self.y_index(d, s, b)
                        with k.loop(h, name="y0") as j:
                            self.st(y, self.add(yi, j), self.c(0.0))
        for out_index, state in ((1, self.h_state), (2, self.c_state)):
            out = self.output_ptr(out_index)
            if out is None:
                continue
            with k.loop(geo.batch, name="final") as b:
                # a row whose sequence is empty ends with zero states (onnxruntime's choice)
                empty = k.b.icmp_signed("==", self.seq_len(b), k.i64(0))
                dst = self.state_index(d, b)
                src = self.mul(b, h)
                with k.loop(h, name="final_k") as j:
                    v = self.ld(state, self.add(src, j))
                    self.st(out, self.add(dst, j), k.b.select(empty, self.c(0.0), v))


@register
class RecurrentScratch(Op):
    """The scratch memory of a recurrent node (see the module docstring): no code."""

    op_type = "RecurrentScratch"
    domain = "cuvil"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        return [node.outputs[0].type]

    def lower(self, node: Node, k: Emitter) -> None:
        pass


def _rows(low: _Lowering, d: int, b: ir.Value, row: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Pointers to the projection row of (row, d), the h state of b and R of direction d."""
    k, geo = low.k, low.geo
    g = geo.gates * geo.hidden
    prow = low._ptr(low.proj, low.add(low.mul(row, k.i64(geo.dirs * g)), k.i64(d * g)))
    hrow = low._ptr(low.h_state, low.mul(b, k.i64(geo.hidden)))
    r = low.input_ptr(2)
    assert r is not None
    return prow, hrow, low._ptr(r, k.i64(d * g * geo.hidden))


def _recurrent_products(low: _Lowering, prow: ir.Value | None, vec: ir.Value, rmat: ir.Value,
                        first: int, count: int) -> None:
    """gate_row[j] = prow[j] + R[j] . vec for j in [first, first + count)."""
    k = low.k
    hid = k.i64(low.geo.hidden)
    with k.loop(first + count, start=first, name="gate") as j:
        init = low.ld(prow, j) if prow is not None else low.c(0.0)
        low.st(low.gate_row, j, low.dot(low._ptr(rmat, low.mul(j, hid)), vec, hid, init))


@register
class RNN(_Recurrent):
    """Ht = f(Xt*W^T + Ht-1*R^T + Wb + Rb)."""

    op_type = "RNN"
    gates = 1
    n_inputs = 6
    default_acts = ("Tanh",)
    input_names = ("X", "W", "R", "B", "sequence_lens", "initial_h")

    def step(self, low: _Lowering, d: int, b: ir.Value, row: ir.Value) -> None:
        k, hid = low.k, low.geo.hidden
        prow, hrow, rmat = _rows(low, d, b, row)
        _recurrent_products(low, prow, hrow, rmat, 0, hid)
        with k.loop(hid, name="unit") as j:
            low.st(hrow, j, low.activate(d, 0, low.ld(low.gate_row, j)))


@register
class GRU(_Recurrent):
    """Gates z, r, h (in W, R and B in that order); linear_before_reset picks where r applies."""

    op_type = "GRU"
    gates = 3
    n_inputs = 6
    default_acts = ("Sigmoid", "Tanh")
    input_names = ("X", "W", "R", "B", "sequence_lens", "initial_h")

    def recurrent_bias_apart(self, node: Node) -> bool:
        return bool(node.attrs.get("linear_before_reset", 0))

    def step(self, low: _Lowering, d: int, b: ir.Value, row: ir.Value) -> None:
        k, geo = low.k, low.geo
        hid = geo.hidden
        prow, hrow, rmat = _rows(low, d, b, row)
        gr = low.gate_row
        fb = k.b
        one = low.c(1.0)
        if self.recurrent_bias_apart(low.node):
            # h~ = g(Xt*Wh^T + r * (Ht-1*Rh^T + Rbh) + Wbh)
            _recurrent_products(low, prow, hrow, rmat, 0, 2 * hid)
            bias = low.input_ptr(3)
            with k.loop(hid, name="gate_h") as j:
                jj = low.add(j, k.i64(2 * hid))
                init = (low.ld(bias, low.add(j, k.i64(d * 6 * hid + 5 * hid))) if bias is not None
                        else low.c(0.0))
                low.st(gr, jj, low.dot(low._ptr(rmat, low.mul(jj, k.i64(hid))), hrow, k.i64(hid),
                                       init))
            with k.loop(hid, name="unit") as j:
                z = low.activate(d, 0, low.ld(gr, j))
                r = low.activate(d, 0, low.ld(gr, low.add(j, k.i64(hid))))
                jj = low.add(j, k.i64(2 * hid))
                pre = fb.fadd(low.ld(prow, jj), fb.fmul(r, low.ld(gr, jj)))
                cand = low.activate(d, 1, pre)
                hv = low.ld(hrow, j)
                low.st(hrow, j, fb.fadd(fb.fmul(fb.fsub(one, z), cand), fb.fmul(z, hv)))
            return
        # h~ = g(Xt*Wh^T + (r * Ht-1)*Rh^T + Rbh + Wbh): r first, then the candidate's product
        _recurrent_products(low, prow, hrow, rmat, 0, 2 * hid)
        with k.loop(hid, name="reset") as j:
            r = low.activate(d, 0, low.ld(gr, low.add(j, k.i64(hid))))
            low.st(low.aux_row, j, fb.fmul(r, low.ld(hrow, j)))
        _recurrent_products(low, prow, low.aux_row, rmat, 2 * hid, hid)
        with k.loop(hid, name="unit") as j:
            z = low.activate(d, 0, low.ld(gr, j))
            cand = low.activate(d, 1, low.ld(gr, low.add(j, k.i64(2 * hid))))
            hv = low.ld(hrow, j)
            low.st(hrow, j, fb.fadd(fb.fmul(fb.fsub(one, z), cand), fb.fmul(z, hv)))


@register
class LSTM(_Recurrent):
    """Gates i, o, f, c (in W, R and B in that order), peepholes P = [Pi, Po, Pf]."""

    op_type = "LSTM"
    gates = 4
    n_inputs = 8
    default_acts = ("Sigmoid", "Tanh", "Tanh")
    input_names = ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")

    def _check_attrs(self, node: Node) -> None:
        if node.attrs.get("input_forget", 0) not in (0, 1):
            raise ModelError(f"{node.describe()}: input_forget must be 0 or 1")

    def step(self, low: _Lowering, d: int, b: ir.Value, row: ir.Value) -> None:
        k, geo = low.k, low.geo
        hid = geo.hidden
        prow, hrow, rmat = _rows(low, d, b, row)
        crow = low._ptr(low.c_state, low.mul(b, k.i64(hid)))
        peep = low.input_ptr(7)
        couple = bool(low.node.attrs.get("input_forget", 0))
        gr = low.gate_row
        fb = k.b
        _recurrent_products(low, prow, hrow, rmat, 0, 4 * hid)

        def gate(j: ir.Value, index: int, cell: ir.Value | None) -> ir.Value:
            pre = low.ld(gr, low.add(j, k.i64(index * hid)))
            if peep is not None and cell is not None:
                # P holds [Pi, Po, Pf]: gate order i=0, o=1, f=2
                p = low.ld(peep, low.add(j, k.i64(d * 3 * hid + index * hid)))
                pre = fb.fadd(pre, fb.fmul(p, cell))
            return pre

        with k.loop(hid, name="unit") as j:
            c_prev = low.ld(crow, j)
            i = low.activate(d, 0, gate(j, 0, c_prev))
            f = fb.fsub(low.c(1.0), i) if couple else low.activate(d, 0, gate(j, 2, c_prev))
            cand = low.activate(d, 1, gate(j, 3, None))
            c_new = fb.fadd(fb.fmul(f, c_prev), fb.fmul(i, cand))
            o = low.activate(d, 0, gate(j, 1, c_new))
            low.st(crow, j, c_new)
            low.st(hrow, j, fb.fmul(o, low.activate(d, 2, c_new, clip=False)))
