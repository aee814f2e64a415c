"""Elementwise ops: arithmetic, comparisons, logic, casts, math functions and activations.

Every op here reads its operands under numpy broadcasting and writes one output element per
output index (`emit_elementwise`), so the loops are flat, branch-free and vectorizable.
Dtype rules come from the ONNX schema of the node's opset: inputs that share a type
parameter must have equal dtypes, and each must be one the schema allows; the output dtype
is the bound type parameter (or the schema's single type, e.g. bool for comparisons).
float16 is computed in float32 (converted on load and store), as onnxruntime does.
Exponentials, logarithms, tanh and erf come from `kernels.vecmath` (vectorizable); the
other transcendental functions call libm.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import onnx
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Node, TensorType, Value
from cuvil.compiler.kernels import vecmath
from cuvil.compiler.kernels.emitter import I1, I8, I32, I64, Emitter, View, llvm_type
from cuvil.compiler.ops import (
    Element,
    ElementFn,
    InferContext,
    Op,
    attr,
    broadcast_shapes,
    compute_dtype,
    register,
    required_input,
    schema,
)
from cuvil.errors import ModelError, UnsupportedOpError

F16 = np.dtype("float16")
F32 = np.dtype("float32")
F64 = np.dtype("float64")
BOOL = np.dtype("bool")

# -- broadcasting loops ----------------------------------------------------------------------


def _collapse(out_shape: Sequence[Dim], in_shapes: Sequence[Sequence[Dim]]) -> list[list[int]]:
    """Group output axes that every operand walks contiguously, so loops can be merged.

    Axes a and a+1 merge when each input either broadcasts along both or along neither.
    Returns the groups of axis indices; axes of size 1 are dropped.
    """
    rank = len(out_shape)
    flags = []
    for shape in in_shapes:
        padded = (1,) * (rank - len(shape)) + tuple(shape)
        flags.append([padded[a] == 1 and out_shape[a] != 1 for a in range(rank)])
    groups: list[list[int]] = []
    for a in range(rank):
        if out_shape[a] == 1:
            continue
        if groups and all(f[groups[-1][-1]] == f[a] for f in flags):
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


#: elements per task when a contiguous loop is split over threads
BLOCK = 8192
#: static loops with less work than this (elements x cost) stay plain loops: the runtime would
#: run them inline anyway, and a plain loop compiles to less code
SERIAL_WORK = 32768


def emit_elementwise(
    k: Emitter, out: Value, inputs: Sequence[Value],
    fn: ElementFn, cost: int = 1, interleave: int = 0,
) -> None:
    """out[i] = fn(inputs[0][i], inputs[1][i], ...) under numpy broadcasting.

    Axes are merged where every operand allows it; the outermost merged axis (or blocks of
    a single contiguous one) is spread over the runtime's threads, the innermost stays a
    plain counted loop for the vectorizer. `cost` is the work of one element in
    multiply-adds (the runtime runs small jobs inline). `interleave`: the vectorizer runs
    this many vector iterations side by side (0: its own choice, 1 for long bodies, whose
    chains of dependent steps then leave the CPU waiting).
    """
    shape = out.type.shape
    groups = _collapse(shape, [v.type.shape for v in inputs])
    rank = len(shape)
    full = [_product([shape[a] for a in g]) for g in groups]

    def views() -> tuple[View, list[View]]:
        def merged(value: Value) -> View:
            padded = (1,) * (rank - value.type.rank) + tuple(value.type.shape)
            dims = [_product([padded[a] for a in g]) for g in groups]
            flat = Value(value.name, TensorType(value.type.dtype, tuple(dims)))
            k.buffers[flat] = k.buffers[value]
            return k.broadcast_to(k.view(flat), full)

        return merged(out), [merged(v) for v in inputs]

    def body(out_view: View, in_views: list[View], idx: list[ir.Value]) -> None:
        values = [k.load(v, idx) for v in in_views]
        k.store(out_view, idx, fn(k, values))
        loop_indices.extend(idx)

    loop_indices: list[ir.Value] = []
    total = _product(full)
    if not groups or (isinstance(total, int) and total * cost < SERIAL_WORK):
        out_view, in_views = views()
        with k.loops(out_view.dims) as idx:
            body(out_view, in_views, idx)
        _keep_rolled(k, loop_indices, interleave)
        return
    if len(groups) == 1:
        total = k.dim(full[0])
        blocks = k.b.sdiv(k.b.add(total, k.i64(BLOCK - 1)), k.i64(BLOCK))
        with k.parallel_loop(blocks, cost=BLOCK * cost, name="blk") as blk:
            out_view, in_views = views()
            n = k.dim(full[0])
            start = k.b.mul(blk, k.i64(BLOCK))
            stop = k.b.add(start, k.i64(BLOCK))
            stop = k.b.select(k.b.icmp_signed("<", stop, n), stop, n)
            with k.loop(stop, start=start) as i:
                body(out_view, in_views, [i])
        _keep_rolled(k, loop_indices, interleave)
        return
    inner = _product(full[1:])
    with k.parallel_loop(full[0], cost=inner * cost, name="row") as i0:
        out_view, in_views = views()
        with k.loops(out_view.dims[1:]) as idx:
            body(out_view, in_views, [i0, *idx])
    _keep_rolled(k, loop_indices, interleave)


def _keep_rolled(k: Emitter, indices: Sequence[ir.Value], interleave: int = 0) -> None:
    """Mark the closed loops of `indices` (loop phis) not to be unrolled (and to interleave
    `interleave` vector iterations, when not 0).

    Fully unrolled short loops (a broadcast [4, 5] block, say) become long straight-line code
    that the SLP vectorizer spends seconds on; the loop vectorizer still handles the loops.
    The mark goes on each loop's latch branch: the terminator of the phi's back-edge block.
    """
    for phi in indices:
        if not isinstance(phi, ir.PhiInstr):
            continue
        for _, block in phi.incomings[1:]:
            term = block.terminator
            if term is None or "llvm.loop" in term.metadata:
                continue
            hints = [k.module.add_metadata([ir.MetaDataString(k.module,
                                                              "llvm.loop.unroll.disable")])]
            if interleave:
                hints.append(k.module.add_metadata([
                    ir.MetaDataString(k.module, "llvm.loop.interleave.count"),
                    ir.Constant(I32, interleave)]))
            # a loop id is a node of its own whose first operand is itself
            loop_id = ir.values.MDValue(k.module, hints, name=str(len(k.module.metadata)))
            loop_id.operands = (loop_id, *hints)
            term.set_metadata("llvm.loop", loop_id)


def _product(dims: Sequence[Dim]) -> Dim:
    p: Dim = 1
    for d in dims:
        p = p * d
    return p


# -- dtype rules from the ONNX schemas -------------------------------------------------------


def _onnx_type_name(dtype: str) -> str:
    enum = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return f"tensor({onnx.TensorProto.DataType.Name(enum).lower()})"


#: numpy dtype name -> the ONNX schema's type string ("float32" -> "tensor(float)")
_ONNX_NAME = {name: _onnx_type_name(name) for name in DTYPES}
_FROM_ONNX = {v: np.dtype(k) for k, v in _ONNX_NAME.items()}


def _readable(type_strs: set[str]) -> str:
    names = sorted(s[len("tensor("):-1] if s.startswith("tensor(") else s for s in type_strs)
    return ", ".join(names)


def schema_of(node: Node) -> onnx.defs.OpSchema:
    found = schema(node)
    if found is None:
        raise ModelError(f"{node.describe()}: ONNX defines no {node.op_type} at opset {node.opset}; "
                         "re-export the model with a newer opset")
    return found


def bind_types(node: Node, schema: onnx.defs.OpSchema) -> dict[str, np.dtype]:
    """Check the inputs' dtypes against the schema; return type parameter -> dtype."""
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    formals = schema.inputs
    variadic = bool(formals) and formals[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    bound: dict[str, np.dtype] = {}
    first: dict[str, int] = {}
    for i, v in enumerate(node.inputs):
        if v is None:
            continue
        if i >= len(formals) and not variadic:
            raise ModelError(f"{node.describe()}: has {len(node.inputs)} inputs; "
                             f"{node.op_type}-{schema.since_version} takes at most {len(formals)}")
        param = formals[min(i, len(formals) - 1)].type_str
        dtype = v.type.dtype
        if dtype.name not in DTYPES:
            raise UnsupportedOpError(f"{node.describe()}: input {i} ({v.name!r}) has dtype "
                                     f"{dtype.name}; cuvil compiles {', '.join(DTYPES)} only")
        ok = allowed.get(param, {param})
        if _ONNX_NAME[dtype.name] not in ok:
            raise ModelError(
                f"{node.describe()}: input {i} ({v.name!r}) is {dtype.name}, but "
                f"{node.op_type} (opset {schema.since_version}) takes {_readable(ok)} there; "
                "insert a Cast or fix the exporter"
            )
        if param in bound and bound[param] != dtype:
            j = first[param]
            raise ModelError(
                f"{node.describe()}: inputs {j} ({node.inputs[j].name!r}, {bound[param].name}) "  # type: ignore[union-attr]
                f"and {i} ({v.name!r}, {dtype.name}) must have the same dtype; insert a Cast so "
                "they match"
            )
        bound.setdefault(param, dtype)
        first.setdefault(param, i)
    return bound


def _output_dtype(node: Node, schema: onnx.defs.OpSchema, bound: dict[str, np.dtype]) -> np.dtype:
    param = schema.outputs[0].type_str
    if param in bound:
        return bound[param]
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    options = allowed.get(param, {param})
    if len(options) == 1 and next(iter(options)) in _FROM_ONNX:
        return _FROM_ONNX[next(iter(options))]
    raise ModelError(f"{node.describe()}: cannot tell the output dtype")  # pragma: no cover


def spec_dtypes(op_type: str, index: int = 0) -> tuple[str, ...]:
    """The dtypes of cuvil's that the latest ONNX schema allows for an input (documentation)."""
    schema = onnx.defs.get_schema(op_type)
    param = schema.inputs[index].type_str
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    return tuple(d for d in DTYPES if _ONNX_NAME[d] in allowed.get(param, {param}))


def first_opset(op_type: str) -> int:
    """The opset in which ONNX first defines `op_type`."""
    version = onnx.defs.get_schema(op_type).since_version
    while version > 1:
        try:
            version = onnx.defs.get_schema(op_type, version - 1).since_version
        except onnx.defs.SchemaError:
            break
    return version


# -- small code helpers ----------------------------------------------------------------------


def _kind(dtype: np.dtype) -> str:
    return np.dtype(dtype).kind


def _c(like: ir.Value, value: float | int) -> ir.Constant:
    """A constant of `like`'s LLVM type."""
    if isinstance(like.type, (ir.FloatType, ir.DoubleType, ir.HalfType)):
        return ir.Constant(like.type, float(value))
    return ir.Constant(like.type, int(value))


def _intrinsic(k: Emitter, name: str, *args: ir.Value) -> ir.Value:
    ty = args[0].type
    suffix = "f32" if isinstance(ty, ir.FloatType) else "f64"
    full = f"{name}.{suffix}"
    fn = k.module.globals.get(full)
    if fn is None:
        fn = ir.Function(k.module, ir.FunctionType(ty, [ty] * len(args)), full)
    return k.b.call(fn, list(args))


def _libm(k: Emitter, name: str, x: ir.Value) -> ir.Value:
    """A call to libm's `name` (float: `namef`)."""
    full = name + ("f" if isinstance(x.type, ir.FloatType) else "")
    fn = k.module.globals.get(full)
    if fn is None:
        fn = ir.Function(k.module, ir.FunctionType(x.type, [x.type]), full)
    return k.b.call(fn, [x])


def _promote(k: Emitter, x: ir.Value, dtype: np.dtype) -> ir.Value:
    return k.b.fpext(x, llvm_type(F32)) if dtype == F16 else x


def _store_as(k: Emitter, r: ir.Value, dtype: np.dtype) -> ir.Value:
    """A computed value in the output's storage type (i1 -> bool byte, float -> half)."""
    if r.type == I1:
        return k.b.zext(r, I8)
    if dtype == F16 and isinstance(r.type, ir.FloatType):
        return k.b.fptrunc(r, llvm_type(F16))
    return r


def _lt(k: Emitter, dt: np.dtype, a: ir.Value, b: ir.Value) -> ir.Value:
    return k.less(dt, a, b)


def _gt(k: Emitter, dt: np.dtype, a: ir.Value, b: ir.Value) -> ir.Value:
    return k.less(dt, b, a)


def _isnan(k: Emitter, x: ir.Value) -> ir.Value:
    return k.b.fcmp_unordered("uno", x, x)


def _max(k: Emitter, dt: np.dtype, a: ir.Value, b: ir.Value) -> ir.Value:
    """max(a, b); NaN if either is NaN (as onnxruntime's Max)."""
    m = k.b.select(_gt(k, dt, a, b), a, b)
    return k.b.select(_isnan(k, a), a, m) if _kind(dt) == "f" else m


def _min(k: Emitter, dt: np.dtype, a: ir.Value, b: ir.Value) -> ir.Value:
    m = k.b.select(_lt(k, dt, a, b), a, b)
    return k.b.select(_isnan(k, a), a, m) if _kind(dt) == "f" else m


def float_to_int(k: Emitter, v: ir.Value, dst: np.dtype) -> ir.Value:
    """float/double -> integer as C's static_cast does on the platforms onnxruntime ships:
    narrow types go through int32 (so 300.0 -> int8 gives 44, -1.0 -> uint8 gives 255).
    uint32 goes through int64 and uint64 is exact up to 2**64 (negative values wrap, as
    onnxruntime's -1.0 -> 4294967295). Values outside these ranges are undefined
    (onnxruntime's result is too: it differs between its vectorized and scalar loops)."""
    dst = np.dtype(dst)
    if dst.kind == "u" and dst.itemsize >= 4:
        return k.float_to_uint(v, llvm_type(dst))
    if dst.itemsize == 8:
        return k.b.fptosi(v, I64)
    i = k.b.fptosi(v, I32)
    return i if dst.itemsize == 4 else k.b.trunc(i, llvm_type(dst))


def emit_cast(k: Emitter, v: ir.Value, src: np.dtype, dst: np.dtype) -> ir.Value:
    """One element from `src` to `dst` with onnxruntime's Cast semantics."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst:
        return v
    if src == F16:
        v, src = k.b.fpext(v, llvm_type(F32)), F32
        if dst == F32:
            return v
    if dst == BOOL:
        nz = (k.b.fcmp_unordered("!=", v, _c(v, 0)) if _kind(src) == "f"
              else k.b.icmp_unsigned("!=", v, _c(v, 0)))
        return k.b.zext(nz, I8)
    if dst == F16:
        # through float32, as onnxruntime (double -> float16 rounds twice)
        f = emit_cast(k, v, src, F32)
        return k.b.fptrunc(f, llvm_type(F16))
    if _kind(src) == "f" and _kind(dst) in "iu":
        return float_to_int(k, v, dst)
    return k.convert(v, src, dst)


# -- the elementwise base ---------------------------------------------------------------------


class Elementwise(Op):
    """Broadcast the operands, check dtypes against the schema, compute per element.

    `operands` are the inputs that are read elementwise (default: all present inputs).
    `compute` gets them loaded (float16 already widened to float32) and `dt`, the compute
    dtype of operand `main`; it returns the result in that dtype, or an i1 for bool outputs.

    A subclass that names an `op_type` registers itself, from the op's first ONNX version on,
    for the dtypes the newest schema allows its main input (unless it sets `dtypes_fixed`).
    """

    #: how many leading inputs are elementwise operands (None: all)
    arity: ClassVar[int | None] = None
    #: which operand's dtype `compute` is told
    main: ClassVar[int] = 0
    #: widen float16 operands to float32 before `compute`
    promote_half: ClassVar[bool] = True
    #: work per element, in multiply-adds (decides when the loop is worth threads)
    cost: ClassVar[int] = 1
    #: `dtypes` is the class's own list, not the schema's
    dtypes_fixed: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "op_type" not in cls.__dict__:
            return  # a base of other ops
        if not cls.dtypes_fixed:
            cls.dtypes = spec_dtypes(cls.op_type, cls.main)
        if "since" not in cls.__dict__:
            cls.since = first_opset(cls.op_type)
        register(cls)

    def operands(self, node: Node) -> list[Value]:
        ins = node.inputs if self.arity is None else node.inputs[: self.arity]
        return [v for v in ins if v is not None]

    def out_dtype(self, node: Node, schema: onnx.defs.OpSchema,
                  bound: dict[str, np.dtype]) -> np.dtype:
        return _output_dtype(node, schema, bound)

    def check(self, node: Node, schema: onnx.defs.OpSchema, bound: dict[str, np.dtype]) -> None:
        """Attribute checks of the op (raise ModelError/UnsupportedOpError)."""

    def out_shape(self, node: Node, ctx: InferContext) -> tuple[Dim, ...]:
        ops = self.operands(node)
        return broadcast_shapes(node, ctx, *(v.type.shape for v in ops))

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        schema = schema_of(node)
        bound = bind_types(node, schema)
        if not self.operands(node):
            raise ModelError(f"{node.describe()}: needs at least one input")
        self.check(node, schema, bound)
        return [TensorType(self.out_dtype(node, schema, bound), self.out_shape(node, ctx))]

    def fusable(self, node: Node) -> bool:
        return True

    def lower(self, node: Node, k: Emitter) -> None:
        form = self.element(node, k)
        emit_elementwise(k, node.outputs[0], form.operands, form.fn, form.cost)

    def element(self, node: Node, k: Emitter) -> Element:
        ops = self.operands(node)
        out = node.outputs[0]
        dtypes = [v.type.dtype for v in ops]
        main = dtypes[min(self.main, len(dtypes) - 1)]
        dt = compute_dtype(main) if self.promote_half else main

        def fn(k: Emitter, xs: list[ir.Value]) -> ir.Value:
            if self.promote_half:
                xs = [_promote(k, x, d) for x, d in zip(xs, dtypes)]
            return _store_as(k, self.compute(k, node, xs, dt), out.type.dtype)

        return Element(ops, fn, self.cost)

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        raise NotImplementedError


@dataclass(frozen=True)
class Row:
    """An op whose lowering is one function of its loaded operands: fn(k, dt, *operands),
    `dt` being the compute dtype (see `Elementwise`). Its dtypes and first opset are onnx's,
    unless given."""

    op_type: str
    fn: Callable[..., ir.Value]
    cost: int = 1
    dtypes: tuple[str, ...] | None = None
    since: int | None = None


class _RowOp(Elementwise):
    fn: ClassVar[Callable[..., ir.Value]]

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        return type(self).fn(k, dt, *xs)


def table(*rows: Row) -> None:
    """Define (and so register) one op per row."""
    for row in rows:
        body: dict[str, object] = {"op_type": row.op_type, "fn": staticmethod(row.fn),
                                   "cost": row.cost, "__doc__": f"{row.op_type}: a table row.",
                                   "__module__": __name__}
        if row.dtypes is not None:
            body.update(dtypes=row.dtypes, dtypes_fixed=True)
        if row.since is not None:
            body["since"] = row.since
        type(row.op_type, (_RowOp,), body)


def _fold(f: Callable[[Emitter, np.dtype, ir.Value, ir.Value], ir.Value]) -> Callable[..., ir.Value]:
    """A variadic op from a binary one: f(f(x0, x1), x2)..."""
    return lambda k, dt, *xs: functools.reduce(lambda a, b: f(k, dt, a, b), xs)


# -- binary arithmetic ------------------------------------------------------------------------


table(
    Row("Add", lambda k, dt, a, b: k.add(dt, a, b)),
    Row("Sub", lambda k, dt, a, b: k.sub(dt, a, b)),
    Row("Mul", lambda k, dt, a, b: k.mul(dt, a, b)),
)


def _safe_divisor(k: Emitter, dt: np.dtype, b: ir.Value) -> ir.Value:
    """b, with 0 and -1 replaced by 1: x/0 and MIN/-1 trap on x86; callers fix the result."""
    bad = k.b.icmp_unsigned("==", b, _c(b, 0))
    if _kind(dt) == "i":
        bad = k.b.or_(bad, k.b.icmp_signed("==", b, _c(b, -1)))
    return k.b.select(bad, _c(b, 1), b)


class Div(Elementwise):
    """Integer division truncates toward zero (as onnxruntime); x/0 is 0 for integers
    (undefined in onnxruntime, which crashes) so that no input can trap."""

    op_type = "Div"
    cost = 4

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        a, b = xs
        if _kind(dt) == "f":
            return k.b.fdiv(a, b)
        q = k.div(dt, a, _safe_divisor(k, dt, b))
        if _kind(dt) == "i":
            q = k.b.select(k.b.icmp_signed("==", b, _c(b, -1)), k.b.sub(_c(a, 0), a), q)
        return k.b.select(k.b.icmp_unsigned("==", b, _c(b, 0)), _c(a, 0), q)


class Mod(Elementwise):
    """fmod=1: C fmod (sign of the dividend); fmod=0: Python's % (sign of the divisor).
    Integer x mod 0 is 0 here (undefined in ONNX)."""

    op_type = "Mod"
    cost = 16

    def check(self, node: Node, schema: onnx.defs.OpSchema, bound: dict[str, np.dtype]) -> None:
        fmod = int(attr(node, "fmod"))
        if fmod not in (0, 1):
            raise ModelError(f"{node.describe()}: fmod must be 0 or 1, got {fmod}")
        if not fmod and _kind(bound["T"]) == "f" and node.opset < 28:
            raise ModelError(f"{node.describe()}: Mod of floating-point inputs needs fmod=1 before "
                             "opset 28; set fmod=1 (C fmod) or export with opset 28")

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        a, b = xs
        fmod = int(attr(node, "fmod"))
        if _kind(dt) == "f":
            r = k.b.frem(a, b)
            if fmod:
                return r
            # floor mod: move a nonzero remainder to the divisor's side; a zero one takes its sign
            differ = k.b.xor(k.b.fcmp_ordered("<", r, _c(r, 0)), k.b.fcmp_ordered("<", b, _c(b, 0)))
            nonzero = k.b.fcmp_ordered("!=", r, _c(r, 0))
            r = k.b.select(k.b.and_(differ, nonzero), k.b.fadd(r, b), r)
            zero = k.b.fcmp_ordered("==", r, _c(r, 0))
            return k.b.select(zero, _intrinsic(k, "llvm.copysign", _c(r, 0), b), r)
        sb = _safe_divisor(k, dt, b)
        r = k.b.srem(a, sb) if _kind(dt) == "i" else k.b.urem(a, sb)
        if not fmod and _kind(dt) == "i":
            differ = k.b.icmp_signed("<", k.b.xor(r, b), _c(r, 0))
            nonzero = k.b.icmp_signed("!=", r, _c(r, 0))
            r = k.b.select(k.b.and_(differ, nonzero), k.b.add(r, b), r)
        return r


class Pow(Elementwise):
    """Base and exponent may differ in dtype; the output has the base's. As onnxruntime (C++
    std::pow): float32 ** float32 in float32, everything else in float64, converted back."""

    op_type = "Pow"
    cost = 40
    promote_half = True

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x, y = xs
        base = required_input(node, 0).type.dtype
        ydt = compute_dtype(required_input(node, 1).type.dtype)
        small = _small_exponent(node)
        if small is not None:
            r = x
            for _ in range(small - 1):
                r = k.mul(dt, r, x)
            return r
        work = F32 if (dt == F32 and ydt == F32) else F64
        xw = k.convert(x, dt, work)
        yw = k.convert(y, ydt, work)
        r = _intrinsic(k, "llvm.pow", xw, yw)
        if _kind(base) == "f":
            return k.convert(r, work, dt)
        return float_to_int(k, r, base)


def _small_exponent(node: Node) -> int | None:
    """2 or 3 when the exponent is that constant everywhere (x*x is what onnxruntime does)."""
    y = node.input(1)
    if y is None or y.const is None or y.const.size == 0:
        return None
    vals = np.unique(np.asarray(y.const).reshape(-1))
    if len(vals) == 1 and float(vals[0]) in (2.0, 3.0):
        return int(vals[0])
    return None


class BitShift(Elementwise):
    op_type = "BitShift"

    def check(self, node: Node, schema: onnx.defs.OpSchema, bound: dict[str, np.dtype]) -> None:
        direction = attr(node, "direction")
        if direction not in ("LEFT", "RIGHT"):
            raise ModelError(f"{node.describe()}: direction must be \"LEFT\" or \"RIGHT\", "
                             f"got {direction!r}")

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x, y = xs
        bits = dt.itemsize * 8
        in_range = k.b.icmp_unsigned("<", y, _c(y, bits))  # negative counts are huge unsigned
        amount = k.b.and_(y, _c(y, bits - 1))
        if attr(node, "direction") == "LEFT":
            return k.b.select(in_range, k.b.shl(x, amount), _c(x, 0))
        if _kind(dt) == "i":
            return k.b.select(in_range, k.b.ashr(x, amount), k.b.ashr(x, _c(x, bits - 1)))
        return k.b.select(in_range, k.b.lshr(x, amount), _c(x, 0))


table(
    Row("BitwiseAnd", lambda k, dt, a, b: k.b.and_(a, b)),
    Row("BitwiseOr", lambda k, dt, a, b: k.b.or_(a, b)),
    Row("BitwiseXor", lambda k, dt, a, b: k.b.xor(a, b)),
    Row("BitwiseNot", lambda k, dt, x: k.b.xor(x, _c(x, -1))),
)


# -- variadic -------------------------------------------------------------------------------

table(
    Row("Max", _fold(_max)),
    Row("Min", _fold(_min)),
    Row("Sum", _fold(lambda k, dt, a, b: k.add(dt, a, b))),
    Row("Mean", lambda k, dt, *xs: k.b.fdiv(_fold(lambda k, dt, a, b: k.add(dt, a, b))(k, dt, *xs),
                                            _c(xs[0], len(xs)))),
)


# -- comparisons and logic -------------------------------------------------------------------


def _cmp(dt: np.dtype, k: Emitter, op: str, a: ir.Value, b: ir.Value) -> ir.Value:
    if _kind(dt) == "f":
        return k.b.fcmp_ordered(op, a, b)
    if _kind(dt) == "i":
        return k.b.icmp_signed(op, a, b)
    return k.b.icmp_unsigned(op, a, b)


# bool tensors hold 0 or 1 per byte, so logic works on the bytes directly
table(
    Row("Equal", lambda k, dt, a, b: (k.b.fcmp_ordered("==", a, b) if _kind(dt) == "f"
                                      else k.b.icmp_unsigned("==", a, b))),
    Row("Less", _lt),
    Row("Greater", _gt),
    Row("LessOrEqual", lambda k, dt, a, b: _cmp(dt, k, "<=", a, b)),
    Row("GreaterOrEqual", lambda k, dt, a, b: _cmp(dt, k, ">=", a, b)),
    Row("And", lambda k, dt, a, b: k.b.and_(a, b)),
    Row("Or", lambda k, dt, a, b: k.b.or_(a, b)),
    Row("Xor", lambda k, dt, a, b: k.b.xor(a, b)),
    Row("Not", lambda k, dt, x: k.b.xor(x, _c(x, 1))),
    Row("IsNaN", lambda k, dt, x: _isnan(k, x)),
)


class Where(Elementwise):
    op_type = "Where"
    main = 1
    promote_half = False

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        cond = k.b.icmp_unsigned("!=", xs[0], _c(xs[0], 0))
        return k.b.select(cond, xs[1], xs[2])


class IsInf(Elementwise):
    op_type = "IsInf"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        pos = k.b.fcmp_ordered("==", x, _c(x, float("inf")))
        neg = k.b.fcmp_ordered("==", x, _c(x, float("-inf")))
        want_pos = int(attr(node, "detect_positive"))
        want_neg = int(attr(node, "detect_negative"))
        if want_pos and want_neg:
            return k.b.or_(pos, neg)
        if want_pos:
            return pos
        if want_neg:
            return neg
        return ir.Constant(I1, 0)


# -- casts ------------------------------------------------------------------------------------


def to_dtype(node: Node, verb: str) -> np.dtype:
    """The element type named by the node's `to` attribute (Cast, BitCast)."""
    to = attr(node, "to")
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(to)))
    except Exception:
        dtype = None
    if dtype is None or dtype.name not in DTYPES:
        known = int(to) in onnx.TensorProto.DataType.values()
        name = onnx.TensorProto.DataType.Name(int(to)) if known else str(to)
        raise UnsupportedOpError(f"{node.describe()}: {verb} to {name}; cuvil compiles tensors of "
                                 f"{', '.join(DTYPES)} only")
    return dtype


class Cast(Elementwise):
    """Any pair of cuvil's dtypes; float -> int truncates, out-of-range results are undefined."""

    op_type = "Cast"
    arity = 1
    promote_half = False
    dtypes_fixed = True
    dtypes = DTYPES

    def target(self, node: Node) -> np.dtype:
        return to_dtype(node, "casts")

    def out_dtype(self, node: Node, schema: onnx.defs.OpSchema,
                  bound: dict[str, np.dtype]) -> np.dtype:
        return self.target(node)

    def element(self, node: Node, k: Emitter) -> Element:
        x = required_input(node, 0)
        src, dst = x.type.dtype, node.outputs[0].type.dtype
        return Element([x], lambda k, xs: emit_cast(k, xs[0], src, dst))


class CastLike(Cast):
    op_type = "CastLike"

    def target(self, node: Node) -> np.dtype:
        like = required_input(node, 1)
        return like.type.dtype

    def out_dtype(self, node: Node, schema: onnx.defs.OpSchema,
                  bound: dict[str, np.dtype]) -> np.dtype:
        return self.target(node)


# -- unary math -------------------------------------------------------------------------------


def _abs(k: Emitter, dt: np.dtype, x: ir.Value) -> ir.Value:
    if _kind(dt) == "f":
        return _intrinsic(k, "llvm.fabs", x)
    if _kind(dt) == "u":
        return x
    return k.b.select(k.b.icmp_signed("<", x, _c(x, 0)), k.b.sub(_c(x, 0), x), x)


def _sign(k: Emitter, dt: np.dtype, x: ir.Value) -> ir.Value:
    pos = _gt(k, dt, x, _c(x, 0))
    neg = _lt(k, dt, x, _c(x, 0))
    r = k.b.select(pos, _c(x, 1), k.b.select(neg, _c(x, -1), _c(x, 0)))
    return k.b.select(_isnan(k, x), x, r) if _kind(dt) == "f" else r


def _round_half_even(k: Emitter, x: ir.Value) -> ir.Value:
    # adding 2^p (p = mantissa bits) rounds |x| < 2^p to an integer in the current (nearest-
    # even) mode; larger values, inf and NaN are integers already or stay as they are
    big = _c(x, 2.0 ** (23 if isinstance(x.type, ir.FloatType) else 52))
    a = _intrinsic(k, "llvm.fabs", x)
    r = k.b.fsub(k.b.fadd(a, big), big)
    r = _intrinsic(k, "llvm.copysign", r, x)
    return k.b.select(k.b.fcmp_ordered("<", a, big), r, x)


def _libm_fn(name: str) -> Callable[[Emitter, np.dtype, ir.Value], ir.Value]:
    return lambda k, dt, x: _libm(k, name, x)


def _hard_sigmoid(k: Emitter, x: ir.Value, alpha: float, beta: float) -> ir.Value:
    y = k.b.fadd(k.b.fmul(x, _c(x, alpha)), _c(x, beta))
    y = k.b.select(k.b.fcmp_ordered(">", y, _c(x, 1)), _c(x, 1), y)
    return k.b.select(k.b.fcmp_ordered("<", y, _c(x, 0)), _c(x, 0), y)


# costs: work per element in multiply-adds, for threading decisions (40: a libm call)
table(
    Row("Abs", _abs),
    Row("Neg", lambda k, dt, x: k.b.fneg(x) if _kind(dt) == "f" else k.b.sub(_c(x, 0), x)),
    Row("Sign", _sign),
    Row("Relu", lambda k, dt, x: k.b.select(_lt(k, dt, x, _c(x, 0)), _c(x, 0), x)),
    Row("Exp", lambda k, dt, x: vecmath.exp(k.b, x), cost=12),
    Row("Log", lambda k, dt, x: vecmath.log(k.b, x), cost=14),
    Row("Tanh", lambda k, dt, x: vecmath.tanh(k.b, x), cost=18),
    Row("Erf", lambda k, dt, x: vecmath.erf(k.b, x), cost=20),
    Row("Sigmoid", lambda k, dt, x: vecmath.sigmoid(k.b, x), cost=16),
    Row("Softplus", lambda k, dt, x: vecmath.softplus(k.b, x), cost=32),
    Row("Sqrt", lambda k, dt, x: _intrinsic(k, "llvm.sqrt", x), cost=4),
    Row("Floor", lambda k, dt, x: _intrinsic(k, "llvm.floor", x), cost=40),
    Row("Ceil", lambda k, dt, x: _intrinsic(k, "llvm.ceil", x), cost=40),
    Row("Round", lambda k, dt, x: _round_half_even(k, x), cost=40),
    Row("Reciprocal", lambda k, dt, x: k.b.fdiv(_c(x, 1), x), cost=4),
    Row("Softsign", lambda k, dt, x: k.b.fdiv(x, k.b.fadd(_c(x, 1), _intrinsic(k, "llvm.fabs", x))),
        cost=4),
    Row("Mish", lambda k, dt, x: k.b.fmul(x, vecmath.tanh(k.b, vecmath.softplus(k.b, x))), cost=50),
    Row("HardSwish", lambda k, dt, x: k.b.fmul(x, _hard_sigmoid(k, x, 1 / 6, 0.5))),
    # libm: accuracy first (LLVM's intrinsics for these become libm calls too)
    Row("Sin", lambda k, dt, x: _intrinsic(k, "llvm.sin", x), cost=40),
    Row("Cos", lambda k, dt, x: _intrinsic(k, "llvm.cos", x), cost=40),
    *(Row(name, _libm_fn(name.lower()), cost=40)
      for name in ("Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")),
)


# -- activations ------------------------------------------------------------------------------


class LeakyRelu(Elementwise):
    op_type = "LeakyRelu"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        scaled = k.b.fmul(x, _c(x, attr(node, "alpha")))
        return k.b.select(k.b.fcmp_ordered("<", x, _c(x, 0)), scaled, x)


class PRelu(Elementwise):
    """slope broadcasts to X (unidirectionally): the output has X's shape."""

    op_type = "PRelu"

    def out_shape(self, node: Node, ctx: InferContext) -> tuple[Dim, ...]:
        x, slope = required_input(node, 0), required_input(node, 1)
        shape = super().out_shape(node, ctx)
        if len(shape) != x.type.rank or any(a != b for a, b in zip(shape, x.type.shape)):
            raise ModelError(f"{node.describe()}: slope of shape {list(slope.type.shape)} must "
                             f"broadcast to X's shape {list(x.type.shape)} without growing it")
        return x.type.shape

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x, slope = xs
        return k.b.select(_lt(k, dt, x, _c(x, 0)), k.mul(dt, x, slope), x)


class Elu(Elementwise):
    op_type = "Elu"
    cost = 14

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        neg = k.b.fmul(_c(x, attr(node, "alpha")), vecmath.expm1(k.b, x))
        return k.b.select(k.b.fcmp_ordered("<", x, _c(x, 0)), neg, x)


class Selu(Elementwise):
    op_type = "Selu"
    cost = 14

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        alpha = attr(node, "alpha")
        gamma = attr(node, "gamma")
        neg = k.b.fmul(_c(x, alpha), vecmath.expm1(k.b, x))
        r = k.b.select(k.b.fcmp_ordered(">", x, _c(x, 0)), x, neg)
        return k.b.fmul(_c(x, gamma), r)


class Celu(Elementwise):
    op_type = "Celu"
    cost = 16

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        alpha = attr(node, "alpha")
        neg = k.b.fmul(_c(x, alpha), vecmath.expm1(k.b, k.b.fdiv(x, _c(x, alpha))))
        return k.b.select(k.b.fcmp_ordered(">", x, _c(x, 0)), x, neg)


class ThresholdedRelu(Elementwise):
    op_type = "ThresholdedRelu"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        return k.b.select(k.b.fcmp_ordered(">", x, _c(x, attr(node, "alpha"))), x, _c(x, 0))


class HardSigmoid(Elementwise):
    op_type = "HardSigmoid"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        return _hard_sigmoid(k, xs[0], attr(node, "alpha"), attr(node, "beta"))


class Gelu(Elementwise):
    op_type = "Gelu"
    cost = 24

    def check(self, node: Node, schema: onnx.defs.OpSchema, bound: dict[str, np.dtype]) -> None:
        if attr(node, "approximate") not in ("none", "tanh"):
            raise ModelError(f"{node.describe()}: approximate must be \"none\" or \"tanh\", got "
                             f"{attr(node, 'approximate')!r}")

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        b = k.b
        if attr(node, "approximate") == "tanh":
            inner = b.fmul(_c(x, np.sqrt(2 / np.pi)),
                           b.fadd(x, b.fmul(_c(x, 0.044715), b.fmul(x, b.fmul(x, x)))))
            t = vecmath.tanh(b, inner)
        else:
            t = vecmath.erf(b, b.fmul(x, _c(x, np.sqrt(0.5))))
        return b.fmul(b.fmul(_c(x, 0.5), x), b.fadd(_c(x, 1), t))


class Clip(Elementwise):
    """Bounds are attributes before opset 11, optional scalar inputs (run-time values are
    fine) from 11 on; an absent bound is the dtype's lowest/max (so floats clip infinities).
    Clip(NaN) is NaN; min > max gives max, as the spec says."""

    op_type = "Clip"

    def out_shape(self, node: Node, ctx: InferContext) -> tuple[Dim, ...]:
        x = required_input(node, 0)
        for i in (1, 2):
            v = node.input(i)
            if v is not None and v.type.numel != 1:
                raise ModelError(f"{node.describe()}: {('min', 'max')[i - 1]} must be a scalar, "
                                 f"got shape {list(v.type.shape)}")
        return x.type.shape

    def element(self, node: Node, k: Emitter) -> Element:
        x = required_input(node, 0)
        if node.opset >= 11:
            # scalar bounds: read as rank-0 operands so that they broadcast
            ops = [x]
            for i in (1, 2):
                v = node.input(i)
                if v is not None:
                    scalar = Value(v.name, TensorType(v.type.dtype, ()))
                    k.buffers[scalar] = k.buffers[v]
                    ops.append(scalar)
        else:
            ops = [x]
        dt = compute_dtype(x.type.dtype)
        out = node.outputs[0]

        def fn(k: Emitter, xs: list[ir.Value]) -> ir.Value:
            xs = [_promote(k, v, x.type.dtype) for v in xs]
            return _store_as(k, self.compute(k, node, xs, dt), out.type.dtype)

        return Element(ops, fn)

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        y = xs[0]
        if node.opset < 11:
            # Clip-1 states no defaults; these are Clip-6's (the float range)
            lo: ir.Value | None = _c(y, attr(node, "min", -3.4028234663852886e38))
            hi: ir.Value | None = _c(y, attr(node, "max", 3.4028234663852886e38))
        else:
            rest = iter(xs[1:])
            lo = next(rest) if node.input(1) is not None else None
            hi = next(rest) if node.input(2) is not None else None
            if _kind(dt) == "f":
                # absent bounds are the dtype's lowest/max: Clip(inf) is the largest finite
                big = float(np.finfo(required_input(node, 0).type.dtype).max)
                lo = _c(y, -big) if lo is None else lo
                hi = _c(y, big) if hi is None else hi
        if lo is not None:
            y = k.b.select(_lt(k, dt, y, lo), lo, y)
        if hi is not None:
            y = k.b.select(_gt(k, dt, y, hi), hi, y)
        return y


class Shrink(Elementwise):
    """x < -lambd: x + bias; x > lambd: x - bias; else 0. Integers are computed in float32
    and truncated back, as onnxruntime does."""

    op_type = "Shrink"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value], dt: np.dtype) -> ir.Value:
        x = xs[0]
        work = F64 if dt == F64 else F32
        xf = k.convert(x, dt, work)
        lambd, bias = attr(node, "lambd"), attr(node, "bias")
        lo = k.b.fcmp_ordered("<", xf, _c(xf, -lambd))
        hi = k.b.fcmp_ordered(">", xf, _c(xf, lambd))
        r = k.b.select(lo, k.b.fadd(xf, _c(xf, bias)),
                       k.b.select(hi, k.b.fsub(xf, _c(xf, bias)), _c(xf, 0)))
        if _kind(dt) == "f":
            return r
        return float_to_int(k, r, dt)


# -- identities -------------------------------------------------------------------------------


class Copy(Op):
    """Ops whose output 0 is input 0 unchanged; lowered as a copy when not aliased away."""

    is_view = True
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        emit_copy(k, node.inputs[0], node.outputs[0])


def emit_copy(k: Emitter, src: Value | None, dst: Value) -> None:
    assert src is not None
    if k.buffers[src] is k.buffers[dst]:
        return
    k.memcpy(k.buffers[dst], k.buffers[src], k.dim(dst.type.nbytes))


@register
class Identity(Copy):
    op_type = "Identity"


@register
class Dropout(Copy):
    """Inference-mode Dropout: the data passes through; the optional mask is all true."""

    op_type = "Dropout"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        training = node.input(2)
        if training is not None and (training.const is None or bool(training.const)):
            raise ModelError(
                f"{node.describe()}: training_mode must be a constant false for inference; "
                "export the model in eval mode"
            )
        x = required_input(node, 0)
        types = [x.type]
        if len(node.outputs) > 1:
            types.append(TensorType(BOOL, x.type.shape))
        return types

    def lower(self, node: Node, k: Emitter) -> None:
        emit_copy(k, node.inputs[0], node.outputs[0])
        if len(node.outputs) > 1:
            mask = node.outputs[1]
            k.memset(k.buffers[mask], 1, k.dim(mask.type.nbytes))


@register
class BitCast(Copy):
    """The input's bytes read as another dtype of the same width: no conversion, and no copy
    when the memory planner lets the output share the input's storage."""

    op_type = "BitCast"
    since = 26

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        dtype = to_dtype(node, "bit-casts")
        if dtype.itemsize != x.type.dtype.itemsize:
            raise ModelError(f"{node.describe()}: cannot bit-cast {x.type.dtype.name} "
                             f"({8 * x.type.dtype.itemsize} bits) to {dtype.name} "
                             f"({8 * dtype.itemsize} bits); BitCast needs types of the same width")
        return [TensorType(dtype, x.type.shape)]
