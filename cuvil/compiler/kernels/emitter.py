"""The building blocks op lowerings write code with: views of tensors, loops, loads, math.

A lowering gets an `Emitter` positioned inside the node's own LLVM function. It asks for
`view(value)` of its inputs and outputs (pointer + dims + strides as LLVM values), opens
loops, and loads/stores elements by multi-dimensional index. Symbolic dims are computed from
the run-time dim array once per function. Loops are plain counted loops with phi nodes so
that LLVM's vectorizer recognises them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Value
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.compiler.symbolic import lower_dim
from cuvil.runtime import STATUS_INDEX_OUT_OF_RANGE

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
PTR = ir.PointerType()

_LLVM_TYPES: dict[str, ir.Type] = {
    "float32": ir.FloatType(),
    "float64": ir.DoubleType(),
    "float16": ir.HalfType(),
    "int8": I8,
    "uint8": I8,
    "uint16": ir.IntType(16),
    "uint32": I32,
    "uint64": I64,
    "bool": I8,
    "int16": ir.IntType(16),
    "int32": I32,
    "int64": I64,
}


#: fast-math flags for reductions: reassociation lets LLVM vectorize sums. Results stay
#: within the tolerance the tests hold against onnxruntime (which reassociates too).
REDUCE_FLAGS = ("reassoc", "contract")


def llvm_type(dtype: np.dtype | str) -> ir.Type:
    return _LLVM_TYPES[np.dtype(dtype).name]


@dataclass(frozen=True)
class View:
    """A tensor as seen by generated code: element pointer, dims and strides (in elements)."""

    ptr: ir.Value
    dtype: np.dtype
    dims: tuple[ir.Value, ...]
    strides: tuple[ir.Value, ...]
    shape: tuple[Dim, ...]  # the IR dims, for decisions taken at compile time

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def elem(self) -> ir.Type:
        return llvm_type(self.dtype)

    def permuted(self, perm: Sequence[int]) -> View:
        """The same elements seen as the tensor's Transpose by `perm`: no data moves."""
        return replace(self, dims=tuple(self.dims[a] for a in perm),
                       strides=tuple(self.strides[a] for a in perm),
                       shape=tuple(self.shape[a] for a in perm))


class _LLVMIntOps:
    def __init__(self, k: Emitter) -> None:
        self.k = k

    def const(self, value: int) -> ir.Value:
        return ir.Constant(I64, value)

    def sym(self, name: str) -> ir.Value:
        return self.k.symbol_value(name)

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.b.add(a, b)

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.b.mul(a, b)

    def floordiv(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.floordiv(a, b)

    def mod(self, a: ir.Value, b: ir.Value) -> ir.Value:
        q = self.k.floordiv(a, b)
        return self.k.b.sub(a, self.k.b.mul(q, b))

    def max(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.b.select(self.k.b.icmp_signed(">", a, b), a, b)

    def min(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.b.select(self.k.b.icmp_signed("<", a, b), a, b)


class Emitter:
    """Writes one function's body for `target`. `buffers` maps the IR values it reads/writes
    to pointers."""

    def __init__(
        self,
        module: ir.Module,
        function: ir.Function,
        dims_ptr: ir.Value,
        symbols: Sequence[str],
        buffers: dict[Value, ir.Value],
        target: KernelTarget,
    ) -> None:
        self.module = module
        self.target = target
        self.function = function
        self.b = ir.IRBuilder(function.append_basic_block("entry"))
        self._dims_ptr = dims_ptr
        self._symbol_index = {name: i for i, name in enumerate(symbols)}
        self._symbol_values: dict[str, ir.Value] = {}
        #: per function (`parallel_loop` makes more): `lower_dim`'s memo of dim arithmetic
        self._dim_memos: dict[ir.Function, dict[int, Any]] = {}
        self.buffers = buffers
        #: inside `parallel_loop(carry=...)`: the body's copies of the carried values
        self.carried: list[ir.Value] = []
        #: inside a `parallel_loop` body, the first iteration this call of it runs (else None)
        self.task_first: ir.Value | None = None
        #: the node's scratch memory (`Op.scratch_bytes`), 64-byte aligned; None if it has none
        self.scratch: ir.Value | None = None
        #: the node's weights derived at run time (`Op.derived_bytes`), 64-byte aligned
        self.derived: ir.Value | None = None

    @property
    def symbols(self) -> list[str]:
        """The dim symbols in the order of the run-time dim array (for emitting more functions)."""
        return list(self._symbol_index)

    @property
    def dims_ptr(self) -> ir.Value:
        """The current function's pointer to the run-time dim array."""
        return self._dims_ptr

    # -- constants and dims -------------------------------------------------------------
    @staticmethod
    def i64(n: int) -> ir.Constant:
        return ir.Constant(I64, int(n))

    def const(self, dtype: np.dtype | str, value: float | int) -> ir.Constant:
        dtype = np.dtype(dtype)
        if dtype.kind == "f":
            return ir.Constant(llvm_type(dtype), float(value))
        return ir.Constant(llvm_type(dtype), int(value))

    def constant_table(self, values: np.ndarray, name: str) -> ir.GlobalVariable:
        """`values` as a read-only array in the library. LLVM knows that no store reaches a
        constant global, so a loop that reads it by a computed index still vectorizes."""
        ty = ir.ArrayType(llvm_type(values.dtype), values.size)
        g = ir.GlobalVariable(self.module, ty, self.module.get_unique_name(
            f"{self.function.name}.{name}"))
        g.linkage = "private"
        g.global_constant = True
        g.unnamed_addr = True
        g.initializer = ir.Constant(ty, [v.item() for v in values.reshape(-1)])
        return g

    def symbol_value(self, name: str) -> ir.Value:
        if name not in self._symbol_values:
            # loaded in the entry block so every later block can use it
            with self.b.goto_entry_block():
                if self.b.block.terminator is not None:
                    self.b.position_before(self.b.block.terminator)
                p = self.b.gep(self._dims_ptr, [self.i64(self._symbol_index[name])],
                               source_etype=I64, inbounds=True)
                self._symbol_values[name] = self.b.load(p, typ=I64, name=name)
        return self._symbol_values[name]

    def set_dim(self, d: Dim, value: ir.Value) -> None:
        """Store the run-time value (i64) of a data-dependent dim (`ir.DataDim`) in its slot
        of the dim array, where the later nodes and the caller read it. The node that sets it
        must not read it through `dim` (that loads the slot on entry, before the store)."""
        name = getattr(d, "name", None)
        if name is None:  # a bound of 0 made the dim 0: nothing to store
            return
        p = self.b.gep(self._dims_ptr, [self.i64(self._symbol_index[name])], source_etype=I64,
                       inbounds=True)
        self.b.store(value, p)

    def dim(self, d: Dim | ir.Value) -> ir.Value:
        """An i64 LLVM value for an IR dim (int or symbolic expression)."""
        if isinstance(d, ir.Value):
            return d
        if isinstance(d, (int, np.integer)):
            return self.i64(int(d))
        # Computed in the entry block, where the symbols are loaded, once per function: the
        # same dims (and their floor divisions) recur in every loop and workspace offset.
        # Symbols first: `symbol_value` inside `goto_entry_block` would move the builder.
        for name in sorted(str(s) for s in getattr(d, "free_symbols", ())):
            self.symbol_value(name)
        with self.b.goto_entry_block():
            return lower_dim(d, _LLVMIntOps(self), self._dim_memos.setdefault(self.function, {}))

    def unravel(self, flat: ir.Value, shape: Sequence[Dim]) -> list[ir.Value]:
        """The multi-index of row-major position `flat` (>= 0) in `shape`."""
        idx: list[ir.Value] = []
        for d in reversed(shape):
            dv = self.dim(d)
            q = self.b.sdiv(flat, dv)
            idx.append(self.b.sub(flat, self.b.mul(q, dv)))
            flat = q
        return idx[::-1]

    def floordiv(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """Python-style floor division of i64 values (sdiv rounds toward zero)."""
        if isinstance(b, ir.Constant) and isinstance(a, ir.Value) and int(b.constant) > 0:
            # common case: positive constant divisor
            q = self.b.sdiv(a, b)
            r = self.b.srem(a, b)
            neg = self.b.icmp_signed("<", r, self.i64(0))
            return self.b.select(neg, self.b.sub(q, self.i64(1)), q)
        q = self.b.sdiv(a, b)
        r = self.b.srem(a, b)
        signs_differ = self.b.icmp_signed("<", self.b.xor(r, b), self.i64(0))
        nonzero = self.b.icmp_signed("!=", r, self.i64(0))
        adjust = self.b.and_(signs_differ, nonzero)
        return self.b.select(adjust, self.b.sub(q, self.i64(1)), q)

    # -- views --------------------------------------------------------------------------
    def view(self, value: Value) -> View:
        """A contiguous row-major view of an IR value's buffer."""
        return self.contiguous(self.buffers[value], value.type.dtype, value.type.shape)

    def contiguous(self, ptr: ir.Value, dtype: np.dtype, shape: Sequence[Dim]) -> View:
        """A row-major view of `shape` starting at `ptr`."""
        dims = tuple(self.dim(d) for d in shape)
        strides: list[ir.Value] = []
        acc: Dim = 1
        for d in reversed(shape):
            strides.append(self.dim(acc))
            acc = acc * d
        return View(ptr, np.dtype(dtype), dims, tuple(reversed(strides)), tuple(shape))

    def broadcast_to(self, view: View, shape: Sequence[Dim]) -> View:
        """`view` read as if broadcast to `shape` (numpy rules): stride 0 on broadcast axes."""
        pad = len(shape) - view.rank
        zero = self.i64(0)
        dims = [self.dim(d) for d in shape]
        strides = [zero] * pad
        for axis in range(view.rank):
            src = view.shape[axis]
            strides.append(zero if (isinstance(src, int) and src == 1) else view.strides[axis])
        return replace(view, dims=tuple(dims), strides=tuple(strides), shape=tuple(shape))

    def offset(self, view: View, index: Sequence[ir.Value]) -> ir.Value:
        off: ir.Value | None = None
        for i, s in zip(index, view.strides):
            if isinstance(s, ir.Constant) and int(s.constant) == 0:
                continue
            term = i if isinstance(s, ir.Constant) and int(s.constant) == 1 else self.b.mul(i, s)
            off = term if off is None else self.b.add(off, term)
        return off if off is not None else self.i64(0)

    def element_ptr(self, view: View, offset: ir.Value) -> ir.Value:
        return self.b.gep(view.ptr, [offset], source_etype=view.elem, inbounds=True)

    def load(self, view: View, index: Sequence[ir.Value]) -> ir.Value:
        return self.load_at(view, self.offset(view, index))

    def store(self, view: View, index: Sequence[ir.Value], value: ir.Value) -> None:
        self.store_at(view, self.offset(view, index), value)

    def load_at(self, view: View, offset: ir.Value) -> ir.Value:
        return self.b.load(self.element_ptr(view, offset), typ=view.elem)

    def store_at(self, view: View, offset: ir.Value, value: ir.Value) -> None:
        self.b.store(value, self.element_ptr(view, offset))

    # -- control flow -------------------------------------------------------------------
    @contextmanager
    def loop(self, stop: Dim | ir.Value, start: Dim | ir.Value = 0, step: int | ir.Value = 1,
             name: str = "i") -> Iterator[ir.Value]:
        """`for i in range(start, stop, step)` with a positive step (an int, or an i64 known
        to be positive at run time)."""
        b = self.b
        start_v, stop_v = self.dim(start), self.dim(stop)
        pre = b.block
        header = self.function.append_basic_block(f"{name}.head")
        body = self.function.append_basic_block(f"{name}.body")
        done = self.function.append_basic_block(f"{name}.done")
        b.branch(header)
        b.position_at_end(header)
        i = b.phi(I64, name=name)
        i.add_incoming(start_v, pre)
        b.cbranch(b.icmp_signed("<", i, stop_v), body, done)
        b.position_at_end(body)
        yield i
        nxt = b.add(i, step if isinstance(step, ir.Value) else self.i64(step))
        nxt.flags.append("nsw")
        i.add_incoming(nxt, b.block)
        b.branch(header)
        b.position_at_end(done)

    @contextmanager
    def loops(self, dims: Sequence[Dim | ir.Value], name: str = "i") -> Iterator[list[ir.Value]]:
        """A nest of loops over `dims`, outermost first; yields the index list."""
        with self._nest(list(dims), [], name) as idx:
            yield idx

    @contextmanager
    def _nest(self, dims: list[Any], acc: list[ir.Value], name: str) -> Iterator[list[ir.Value]]:
        if not dims:
            yield acc
            return
        with self.loop(dims[0], name=f"{name}{len(acc)}") as i, \
                self._nest(dims[1:], [*acc, i], name) as idx:
            yield idx

    @contextmanager
    def parallel_loop(self, stop: Dim | ir.Value, cost: Dim | ir.Value = 1, name: str = "p",
                      carry: Sequence[ir.Value] = ()) -> Iterator[ir.Value]:
        """`for i in range(stop)` with the iterations spread over the runtime's threads.

        `cost` estimates the work of one iteration (about one multiply-add each); the runtime
        runs small loops inline. The body becomes a function of its own, so everything it uses
        must be made inside the block: take views (`k.view`) and dims (`k.dim`) there, not before.
        Other values computed before the loop (pointers or i64) go in `carry`; inside the block
        `k.carried[j]` is the body's copy of `carry[j]`. Node failures (`fail_if`) cannot be
        reported from inside the block.
        """
        n = self.dim(stop)
        cost_v = self.dim(cost)
        carry = list(carry)
        outer = (self.function, self.b, self.buffers, self._symbol_values, self._dims_ptr,
                 self.carried, self.task_first)
        values = list(self.buffers)
        body = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, I64, I64]),
                           self.module.get_unique_name(f"{self.function.name}.{name}"))
        body.linkage = "internal"
        ctx, begin, end = body.args
        self.function = body
        self.b = ir.IRBuilder(body.append_basic_block("entry"))
        self._symbol_values = {}

        def slot(i: int) -> ir.Value:
            p = self.b.gep(ctx, [self.i64(i)], source_etype=PTR, inbounds=True)
            return self.b.load(p, typ=PTR)

        self._dims_ptr = slot(0)
        self.buffers = {v: slot(1 + i) for i, v in enumerate(values)}
        self.carried = []
        for j, c in enumerate(carry):
            raw = slot(1 + len(values) + j)
            self.carried.append(self.b.ptrtoint(raw, I64) if c.type == I64 else raw)
        # one call of the body runs iterations begin..end-1 one after another on one thread:
        # they may share a scratch slot (the first one's), which then stays in its cache
        self.task_first = begin
        try:
            with self.loop(end, start=begin, name=name) as i:
                yield i
            self.b.ret_void()
        finally:
            (self.function, self.b, self.buffers, self._symbol_values, self._dims_ptr,
             self.carried, self.task_first) = outer
        # pack the body's captures (dims and buffers) and hand it to the runtime
        with self.b.goto_entry_block():
            if self.b.block.terminator is not None:
                self.b.position_before(self.b.block.terminator)
            frame = self.b.alloca(PTR, size=self.i64(1 + len(values) + len(carry)))
        carried = [self.b.inttoptr(c, PTR) if c.type == I64 else c for c in carry]
        for i, p in enumerate([self._dims_ptr, *[self.buffers[v] for v in values], *carried]):
            self.b.store(p, self.b.gep(frame, [self.i64(i)], inbounds=True, source_etype=PTR))
        self.b.call(_parallel_for(self.module), [body, frame, n, cost_v])

    def parallel_threads(self) -> ir.Value:
        """The threads (i64) a `parallel_loop` started here would run on now: 1 inside another
        loop's body, while another call holds the pool, or under `num_threads = 1`. Code that
        cuts work into blocks cuts as many as the threads can share evenly."""
        return self.b.sext(self.b.call(_parallel_threads(self.module), []), I64)

    @contextmanager
    def if_then(self, cond: ir.Value) -> Iterator[None]:
        with self.b.if_then(cond):
            yield

    def fail_if(self, cond: ir.Value, status: int = STATUS_INDEX_OUT_OF_RANGE) -> None:
        """Leave the node's function with `status` when `cond` holds; the run stops there."""
        if self.function.return_value.type != I32:
            raise RuntimeError("fail_if cannot be used inside a parallel_loop body")
        with self.b.if_then(cond, likely=False):
            self.b.ret(ir.Constant(I32, status))

    # -- math ---------------------------------------------------------------------------
    def intrinsic(self, name: str, args: Sequence[ir.Value], ty: ir.Type | None = None) -> ir.Value:
        ty = ty or args[0].type
        # the signature spelled out: llvmlite guesses one argument for intrinsics it does not
        # know (llvm.fmuladd), which LLVM's verifier rejects
        fnty = ir.FunctionType(ty, [a.type for a in args])
        fn = self.module.declare_intrinsic(name, [ty], fnty)
        return self.b.call(fn, list(args))

    def fmax(self, a: ir.Value, b: ir.Value) -> ir.Value:
        # llvm.maxnum would drop a NaN in `a`; compare-and-select keeps it, as onnxruntime does
        return self.b.select(self.b.fcmp_ordered("<", a, b), b, a)

    def fmin(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(self.b.fcmp_ordered(">", a, b), b, a)

    def fadd_reduce(self, a: ir.Value, b: ir.Value) -> ir.Value:
        v = self.b.fadd(a, b)
        v.flags.extend(REDUCE_FLAGS)
        return v

    def reduce_lanes(self, v: ir.Value, combine: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
        """combine over the lanes of vector v, halving it each step: log2(lanes) shuffles."""
        lanes = v.type.count
        while lanes > 1:
            half = lanes // 2
            mask = ir.VectorType(I32, half)
            low = self.b.shuffle_vector(v, v, ir.Constant(mask, list(range(half))))
            high = self.b.shuffle_vector(v, v, ir.Constant(mask, list(range(half, lanes))))
            v = combine(low, high)
            lanes = half
        return self.b.extract_element(v, ir.Constant(I32, 0))

    def fmul_add(self, a: ir.Value, b: ir.Value, acc: ir.Value) -> ir.Value:
        """acc + a*b, allowed to fuse into one FMA and to be reassociated across a loop."""
        m = self.b.fmul(a, b)
        m.flags.extend(REDUCE_FLAGS)
        return self.fadd_reduce(acc, m)

    # dtype-aware arithmetic: one call for float, signed and unsigned operands
    def add(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fadd(a, b) if _kind(dtype) == "f" else self.b.add(a, b)

    def sub(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fsub(a, b) if _kind(dtype) == "f" else self.b.sub(a, b)

    def mul(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fmul(a, b) if _kind(dtype) == "f" else self.b.mul(a, b)

    def div(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        """Division as onnxruntime does it: integer division truncates toward zero."""
        kind = _kind(dtype)
        if kind == "f":
            return self.b.fdiv(a, b)
        return self.b.udiv(a, b) if kind in "ub" else self.b.sdiv(a, b)

    def less(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        kind = _kind(dtype)
        if kind == "f":
            return self.b.fcmp_ordered("<", a, b)
        return self.b.icmp_unsigned("<", a, b) if kind in "ub" else self.b.icmp_signed("<", a, b)

    def maximum(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.fmax(a, b) if _kind(dtype) == "f" else self.b.select(self.less(dtype, a, b), b, a)

    def minimum(self, dtype: np.dtype | str, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.fmin(a, b) if _kind(dtype) == "f" else self.b.select(self.less(dtype, b, a), b, a)

    def convert(self, value: ir.Value, src: np.dtype | str, dst: np.dtype | str) -> ir.Value:
        """Cast between dtypes with numpy's rules (float->int truncates, bool is 0/1)."""
        src, dst = np.dtype(src), np.dtype(dst)
        if src == dst:
            return value
        ks, kd = _kind(src), _kind(dst)
        to = llvm_type(dst)
        if kd == "b":
            nz = (self.b.fcmp_unordered("!=", value, ir.Constant(value.type, 0.0)) if ks == "f"
                  else self.b.icmp_unsigned("!=", value, ir.Constant(value.type, 0)))
            return self.b.zext(nz, to)
        if ks == "f" and kd == "f":
            return (self.b.fpext(value, to) if src.itemsize < dst.itemsize
                    else self.b.fptrunc(value, to))
        if ks == "f":
            return self.float_to_uint(value, to) if kd == "u" else self.b.fptosi(value, to)
        if kd == "f":
            return self.b.uitofp(value, to) if ks in "ub" else self.b.sitofp(value, to)
        if src.itemsize == dst.itemsize:
            return value
        if src.itemsize > dst.itemsize:
            return self.b.trunc(value, to)
        return self.b.zext(value, to) if ks in "ub" else self.b.sext(value, to)

    def float_to_uint(self, value: ir.Value, to: ir.IntType) -> ir.Value:
        """float -> unsigned as C's cast does on x86-64 (where onnxruntime runs): exact in
        range, negative values within int64 wrap modulo 2**width (-1.0 -> all ones). LLVM's
        fptoui would make every negative input poison instead."""
        b = self.b
        if to.width < 64:
            return b.trunc(b.fptosi(value, I64), to)
        # [2**63, 2**64) does not fit int64: convert value - 2**63 and put the top bit back
        big = ir.Constant(value.type, 2.0 ** 63)
        low = b.fptosi(value, I64)
        high = b.xor(b.fptosi(b.fsub(value, big), I64), ir.Constant(I64, 1 << 63))
        return b.select(b.fcmp_ordered(">=", value, big), high, low)

    def memcpy(self, dst: ir.Value, src: ir.Value, nbytes: ir.Value) -> None:
        fn = self.module.declare_intrinsic("llvm.memcpy", [PTR, PTR, I64])
        self.b.call(fn, [dst, src, nbytes, ir.Constant(I1, 0)])

    def memset(self, dst: ir.Value, byte: int, nbytes: ir.Value) -> None:
        fn = self.module.declare_intrinsic("llvm.memset", [PTR, I64])
        self.b.call(fn, [dst, ir.Constant(I8, byte), nbytes, ir.Constant(I1, 0)])


_DIVISIONS = ("udiv", "sdiv", "urem", "srem")


def guard_divisions(module: ir.Module) -> None:
    """Every integer division in `module` by a value known only at run time divides by 1
    where that value is 0. A dim of 0 reaches the library when other outputs still hold
    elements (the empty past of a KV cache); most divisions by an extent sit in loops that
    then run no trip, but not all, and x86 traps on a division by 0. A compare and a select
    beside a division's 20 to 90 cycles cost nothing measurable."""
    for fn in module.functions:
        for block in fn.blocks:
            for instr in list(block.instructions):
                divisor = instr.operands[1] if instr.opname in _DIVISIONS else None
                if divisor is None or isinstance(divisor, ir.Constant):
                    continue
                assert isinstance(divisor.type, ir.IntType), instr  # no vector divisions
                b = ir.IRBuilder(block)
                b.position_before(instr)
                zero = b.icmp_unsigned("==", divisor, ir.Constant(divisor.type, 0))
                instr.replace_usage(divisor, b.select(zero, ir.Constant(divisor.type, 1),
                                                      divisor))


def splat(b: ir.IRBuilder, x: ir.Value, width: int) -> ir.Value:
    """A vector of `width` copies of the scalar `x`."""
    vt = ir.VectorType(x.type, width)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(I32, 0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, width), [0] * width))


def transpose_lanes(b: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """The columns of a square matrix held as vectors of its rows (as many rows as lanes, a
    power of two): log2(lanes) rounds of interleaving the first half of the rows with the
    second half."""
    n = len(rows)
    half = n // 2
    lo = _i32_vector([x for j in range(half) for x in (j, n + j)])
    hi = _i32_vector([x for j in range(half, n) for x in (j, n + j)])
    for _ in range(n.bit_length() - 1):
        rows = [b.shuffle_vector(rows[i], rows[i + half], idx)
                for i in range(half) for idx in (lo, hi)]
    return rows


def _i32_vector(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(I32, len(values)), values)


def fmuladd_intrinsic(module: ir.Module, ty: ir.Type) -> ir.Function:
    """llvm.fmuladd for float32 or a vector of them (llvmlite's declare_intrinsic cannot name
    vector overloads)."""
    name = f"llvm.fmuladd.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fmuladd.f32"
    return declare_function(module, name, ty, [ty, ty, ty])


def prefetch(b: ir.IRBuilder, ptr: ir.Value) -> None:
    """A hint to bring the cache line at ptr into the innermost cache (llvm.prefetch: read,
    high locality, data): it never faults, so ptr may lie past the end of a buffer."""
    module = b.block.function.module
    fn = declare_function(module, "llvm.prefetch.p0", ir.VoidType(), [PTR, I32, I32, I32])
    b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def vector_suffix(vt: ir.VectorType) -> str:
    """The name part of an intrinsic's overload for vectors of float32 or integers: v16f32, v64i8."""
    e = vt.element
    return f"v{vt.count}{'f32' if isinstance(e, ir.FloatType) else f'i{e.width}'}"


def masked_intrinsic(module: ir.Module, op: str, vt: ir.VectorType) -> ir.Function:
    """llvm.masked.load (op "load") or llvm.masked.store for vectors of float32 or integers:
    lanes whose mask bit is off are neither read nor written, so they may point outside the
    buffer."""
    name = f"llvm.masked.{op}.{vector_suffix(vt)}.p0"
    mask = ir.VectorType(I1, vt.count)
    if op == "load":
        return declare_function(module, name, vt, [PTR, I32, mask, vt])
    return declare_function(module, name, ir.VoidType(), [vt, PTR, I32, mask])


def store_lanes(b: ir.IRBuilder, x: ir.Value, ptr: ir.Value, mask: ir.Value,
                whole: ir.Value) -> None:
    """Store the lanes of float32 vector x that `mask` selects, as a plain store when the i1
    `whole` says they all are: a masked store is one instruction with AVX-512 but some 20
    micro-ops on AMD's AVX2 cores (Zen 3), so loops use it only at their ragged ends."""
    with b.if_else(whole) as (plain, ragged):
        with plain:
            b.store(x, ptr, align=4)
        with ragged:
            b.call(masked_intrinsic(b.module, "store", x.type),
                   [x, ptr, ir.Constant(I32, 4), mask])


def _kind(dtype: np.dtype | str) -> str:
    """numpy's kind letter: f(loat), i(nt), u(nsigned), b(ool)."""
    return np.dtype(dtype).kind


#: the runtime's parallel-for (cuvil/runtime/threadpool.c), linked into every library
PARALLEL_FOR = "cuvil_parallel_for"
#: and how many threads a parallel loop started now would get (1: it would run inline)
PARALLEL_THREADS = "cuvil_parallel_threads"
#: one bit of CPUID (x86) or of the OS's hardware capabilities (AArch64), for kernels that use
#: instructions beyond their copy's CPU level (int8 VNNI, bf16): (leaf, subleaf, reg, bit) -> 0/1
CPUID_BIT = "cuvil_cpuid_bit"
#: populate(p, bytes): pages for derived weights about to be written whole (codegen/derived.py)
POPULATE = "cuvil_populate"
#: release(p, bytes): the library's weights nothing reads again leave the resident memory
RELEASE = "cuvil_release"


def _parallel_for(module: ir.Module) -> ir.Function:
    return declare_function(module, PARALLEL_FOR, ir.VoidType(), [PTR, PTR, I64, I64])


def _parallel_threads(module: ir.Module) -> ir.Function:
    return declare_function(module, PARALLEL_THREADS, I32, [])


def declare_function(module: ir.Module, name: str, ret: ir.Type,
                     args: Sequence[ir.Type]) -> ir.Function:
    """The function `name` of the module (an intrinsic, a runtime function), declared with
    this signature the first time it is asked for."""
    try:
        return module.get_global(name)
    except KeyError:
        return ir.Function(module, ir.FunctionType(ret, list(args)), name)


def add_target_features(target: KernelTarget, fn: ir.Function, extra: str) -> None:
    """Compile `fn` for the target's features plus `extra` (a kernel that runs behind a CPUID
    test). llvmlite knows no string attributes: this one is written as it is."""
    features = ",".join(f for f in (target.features, extra) if f)
    set.add(fn.attributes, f'"target-features"="{features}"')


def cpuid_gate(module: ir.Module, b: ir.IRBuilder, bit: tuple[int, int, int, int]) -> ir.Value:
    """Whether the CPU has the CPUID `bit` (leaf, subleaf, register, bit), `asked_once`."""
    return asked_once(module, b, "cuvil.cpuid." + ".".join(map(str, bit)), CPUID_BIT, list(bit))


def asked_once(module: ir.Module, b: ir.IRBuilder, name: str, query: str,
               args: list[int]) -> ir.Value:
    """query(*args) != 0 (a runtime function returning i32), asked once per library and kept
    in the internal global `name` (1 yes, 2 no, 0 not asked yet): CPUID traps to the
    hypervisor on virtual machines, too slow for every call of a kernel. Threads racing on the
    first call store the same answer."""
    try:
        cache = module.get_global(name)
    except KeyError:
        cache = ir.GlobalVariable(module, I32, name)
        cache.linkage = "internal"
        cache.initializer = ir.Constant(I32, 0)
    known = b.load_atomic(cache, "monotonic", 4)
    slot = b.alloca(I32)
    b.store(known, slot)
    with b.if_then(b.icmp_signed("==", known, ir.Constant(I32, 0)), likely=False):
        fn = declare_function(module, query, I32, [I32] * len(args))
        has = b.call(fn, [ir.Constant(I32, x) for x in args])
        fresh = b.select(b.icmp_signed("!=", has, ir.Constant(I32, 0)), ir.Constant(I32, 1),
                         ir.Constant(I32, 2))
        b.store_atomic(fresh, cache, "monotonic", 4)
        b.store(fresh, slot)
    return b.icmp_signed("==", b.load(slot), ir.Constant(I32, 1))
