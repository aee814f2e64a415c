"""float32 depthwise convolution computed directly: each output channel reads one input channel
(group == input channels, a channel multiplier of up to MAX_MULTIPLIER), 1-D or 2-D.

Lowered as im2col + GEMM, such a convolution is one product with one or two rows per channel,
which leaves the kernel's register tile nearly empty and pays for the unfolding. Here each
(image, output channel) plane is one iteration of a parallel loop: the channel's kernel taps
are splat into vector registers once, and output rows are computed in pairs (ROW_BLOCK), in
chunks of one vector of outputs, every tap a fused multiply-add of a vector of inputs (loaded
contiguously for stride 1; for stride s, s vectors' worth loaded and every s-th lane kept,
which measured faster than gathers). The two rows of a pair load the input rows they share
once: with 3 x 3 taps, 12 loads feed 18 multiply-adds.

Borders need no per-element test. A kernel row that falls into the top or bottom padding reads
a row of zeros (in the node's scratch memory) instead. Along the row, the chunks that
touch the left or right padding (or pass the row's end) load with a lane mask; the chunks
between them, whose every tap lies inside the input row, load plainly.

The fused epilogue (bias, residual, activation: ops/gemm.py `node_epilogue`) is applied to the
chunk while it is in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, numel
from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.emitter import (
    I32,
    Emitter,
    fmuladd_intrinsic,
    masked_intrinsic,
    splat,
)
from cuvil.compiler.ops import required_input
from cuvil.compiler.ops._window import Window, ceil_div
from cuvil.compiler.ops.gemm import ACTIVATION_PARAMS, FUSED_ACTIVATION, RESIDUAL_SLOT

F32 = ir.FloatType()

#: output channels per input channel this kernel takes; more are a real product, which the
#: GEMM kernel's tiles fill
MAX_MULTIPLIER = 4
#: kernel taps unrolled into one chunk's code (7 x 7 is 49); larger kernels go through im2col
MAX_TAPS = 64
#: a stride s loads s vectors per tap; larger strides (rare) go through im2col
MAX_STRIDE = 4
#: independent sums per chunk (taps go round-robin)
ACCUMULATORS = 4
#: output rows computed together, sharing the loads of the input rows they both read
ROW_BLOCK = 2


def uses_direct_depthwise(node: Node) -> bool:
    """The predicate Conv.lower chooses this kernel by: a float32 1-D or 2-D convolution
    whose groups have one input channel each and at most MAX_MULTIPLIER output channels, with
    at most MAX_TAPS kernel taps and a stride along the row of at most MAX_STRIDE."""
    x, w = required_input(node, 0), required_input(node, 1)
    if node.outputs[0].type.dtype.name != "float32" or x.type.rank not in (3, 4):
        return False
    group = int(node.attrs.get("group", 1))
    taps = numel(w.type.shape[2:])
    stride = int(node.attrs.get("strides", [1] * (x.type.rank - 2))[-1])
    return (int(w.type.shape[1]) == 1 and int(w.type.shape[0]) <= MAX_MULTIPLIER * group
            and isinstance(taps, int) and taps <= MAX_TAPS and stride <= MAX_STRIDE)


def depthwise_scratch_bytes(node: Node) -> Dim:
    """A row of zeros as wide as the input (read by kernel rows in the vertical padding)."""
    x = required_input(node, 0)
    return numel([x.type.shape[-1], 4]) if x.type.rank == 4 else 0


@dataclass(frozen=True)
class _Axis:
    """One spatial axis of the window: input size, output size and the tap geometry."""

    size: Dim
    out: Dim
    kernel: int
    stride: int
    dilation: int
    pad: Dim  # padding before the first element


def lower_conv_depthwise(node: Node, k: Emitter, win: Window) -> None:
    x_val, w_val, b_val = required_input(node, 0), required_input(node, 1), node.input(2)
    y_val, r_val = node.outputs[0], node.input(RESIDUAL_SLOT)
    r = len(win.kernel)
    axes = [_Axis(x_val.type.shape[2 + a], win.out[a], win.kernel[a], win.strides[a],
                  win.dilations[a], win.pads_begin[a]) for a in range(r)]
    rows = axes[0] if r == 2 else None
    cols = axes[-1]
    m = int(w_val.type.shape[0])
    multiplier = m // int(node.attrs.get("group", 1))
    taps = numel(win.kernel)
    assert isinstance(taps, int)
    # narrower vectors for narrow outputs (7 x 7 planes): fewer lanes computed for nothing
    width = k.target.isa.vector
    if isinstance(cols.out, int):
        while width > 4 and width // 2 >= cols.out:
            width //= 2
    writer = _Writer(k, width, cols, activation=node.attrs.get(FUSED_ACTIVATION),
                     params=tuple(node.attrs.get(ACTIVATION_PARAMS, ())))
    carry = []
    if rows is not None:
        assert k.scratch is not None
        k.memset(k.scratch, 0, k.b.mul(k.dim(cols.size), k.i64(4)))
        carry.append(k.scratch)
    planes = numel([y_val.type.shape[0], m])
    cost = numel([*win.out, taps])
    with k.parallel_loop(planes, cost=cost, name="dw", carry=carry) as t:
        b = k.b
        zero_row = k.carried[0] if rows is not None else None
        oc = b.srem(t, k.i64(m))
        # input plane of channel oc // multiplier in the same image: (t - oc) / m * C + ic
        ic_plane = b.add(b.mul(b.sdiv(t, k.i64(m)), k.dim(x_val.type.shape[1])),
                         b.sdiv(oc, k.i64(multiplier)))
        in_plane = k.dim(numel(x_val.type.shape[2:]))
        out_plane = k.dim(numel(win.out))
        x = b.gep(k.buffers[x_val], [b.mul(ic_plane, in_plane)], source_etype=F32)
        y_off = b.mul(t, out_plane)
        y = b.gep(k.buffers[y_val], [y_off], source_etype=F32)
        res = b.gep(k.buffers[r_val], [y_off], source_etype=F32) if r_val is not None else None
        w = b.gep(k.buffers[w_val], [b.mul(oc, k.i64(taps))], source_etype=F32)
        weights = [writer.splat(b.load(b.gep(w, [k.i64(i)], source_etype=F32), typ=F32))
                   for i in range(taps)]
        if b_val is not None:
            init = writer.splat(b.load(b.gep(k.buffers[b_val], [oc], source_etype=F32), typ=F32))
        else:
            init = ir.Constant(writer.vt, None)
        if rows is None:  # a 1-D convolution: one row
            writer.rows(_Block([x], {0: [(0, 0)]}, [(y, res)]), weights, init)
            return
        assert zero_row is not None
        out_rows = k.dim(rows.out)

        def block(oh: ir.Value, count: int) -> None:
            """Output rows oh..oh+count-1: each input row they read is loaded once per tap."""
            offsets: dict[int, list[tuple[int, int]]] = {}
            for q in range(count):
                for kh in range(rows.kernel):
                    offsets.setdefault(q * rows.stride + kh * rows.dilation, []).append((q, kh))
            inputs = []
            for off in offsets:
                ih = b.add(b.mul(oh, k.i64(rows.stride)), b.sub(k.i64(off), k.dim(rows.pad)))
                inside = b.and_(b.icmp_signed(">=", ih, k.i64(0)),
                                b.icmp_signed("<", ih, k.dim(rows.size)))
                row_ptr = b.gep(x, [b.mul(ih, k.dim(cols.size))], source_etype=F32)
                inputs.append(b.select(inside, row_ptr, zero_row))
            outs = []
            for q in range(count):
                y_row = b.mul(b.add(oh, k.i64(q)), k.dim(cols.out))
                outs.append((b.gep(y, [y_row], source_etype=F32),
                             b.gep(res, [y_row], source_etype=F32) if res is not None else None))
            writer.rows(_Block(inputs, dict(enumerate(offsets.values())), outs), weights, init)

        pairs = b.mul(k.floordiv(out_rows, k.i64(ROW_BLOCK)), k.i64(ROW_BLOCK))
        with k.loop(pairs, step=ROW_BLOCK, name="oh") as oh:
            block(oh, ROW_BLOCK)
        with k.loop(out_rows, start=pairs, name="ohl") as oh:
            block(oh, 1)


@dataclass(frozen=True)
class _Block:
    """Output rows computed together: `inputs` are the input rows they read (a row of zeros
    where it is padding); uses[i] lists the (output row, kernel row) pairs reading inputs[i];
    outs[q] is output row q's (output, residual) row pointers."""

    inputs: list[ir.Value]
    uses: dict[int, list[tuple[int, int]]]
    outs: list[tuple[ir.Value, ir.Value | None]]


class _Writer:
    """Emits the code of one output row: chunks of `width` outputs along `cols`."""

    def __init__(self, k: Emitter, width: int, cols: _Axis, activation: str | None,
                 params: tuple[float, ...]) -> None:
        self.k = k
        self.width = width
        self.cols = cols
        self.activation = activation
        self.params = params
        self.vt = ir.VectorType(F32, width)
        #: lanes loaded per tap: `stride` vectors' worth, of which every stride-th lane is used
        self.wide = ir.VectorType(F32, width * cols.stride)

    def splat(self, x: ir.Value) -> ir.Value:
        return splat(self.k.b, x, self.width)

    def rows(self, blk: _Block, weights: list[ir.Value], init: ir.Value) -> None:
        """y[q][o] = epilogue(init + sum over taps (kh, kw) of w * x[kh][o*s + kw*d - pad]) for
        the block's output rows q."""
        k, c, v = self.k, self.cols, self.width
        b = k.b
        out, size, pad = k.dim(c.out), k.dim(c.size), k.dim(c.pad)
        # outputs whose every tap is inside the row: o >= first and (loading whole chunks)
        # o*s + (K-1)*d - pad + s*v <= size for the chunk starting at o
        first = ceil_div(k, pad, c.stride)
        last = k.floordiv(b.sub(b.add(size, pad), k.i64((c.kernel - 1) * c.dilation)),
                          k.i64(c.stride))
        head_stop = k.minimum("int64", first, out)
        head_end = b.mul(ceil_div(k, head_stop, v), k.i64(v))
        interior = k.maximum("int64", k.floordiv(b.sub(k.minimum("int64", last, out), head_end),
                                                 k.i64(v)), k.i64(0))
        tail = b.add(head_end, b.mul(interior, k.i64(v)))
        # the first head chunk and the first tail chunk start at the same place on every row:
        # their lane masks are computed once, out of the row loop (more masked chunks only
        # with a padding or a row end wider than a vector)
        with k.if_then(b.icmp_signed(">", head_stop, k.i64(0))):
            self.chunk(blk, weights, init, k.i64(0), masked=True)
        with k.loop(head_stop, start=k.i64(v), step=v, name="head") as o:
            self.chunk(blk, weights, init, o, masked=True)
        with k.loop(interior, name="body") as j:
            self.chunk(blk, weights, init, b.add(head_end, b.mul(j, k.i64(v))),
                       masked=False)
        with k.if_then(b.icmp_signed("<", tail, out)):
            self.chunk(blk, weights, init, tail, masked=True)
        with k.loop(out, start=b.add(tail, k.i64(v)), step=v, name="tail") as o:
            self.chunk(blk, weights, init, o, masked=True)

    def chunk(self, blk: _Block, weights: list[ir.Value], init: ir.Value, o: ir.Value,
              masked: bool) -> None:
        """Outputs o..o+width-1 of the block's rows; `masked`: lanes past the row's end are not
        stored and taps outside the input row read zeros."""
        k, c = self.k, self.cols
        b = k.b
        start = b.sub(b.mul(o, k.i64(c.stride)), k.dim(c.pad))  # input index of tap 0, lane 0
        wide = self.wide.count
        masks: list[ir.Value] = []
        if masked:
            # lane j of tap kw reads input start + kw*d + j: inside the row when that is in
            # [0, size), one unsigned compare (i32 lanes: row widths fit)
            i32s = ir.VectorType(I32, wide)
            lanes = b.add(splat(b, b.trunc(start, I32), wide),
                          ir.Constant(i32s, list(range(wide))))
            size = splat(b, b.trunc(k.dim(c.size), I32), wide)
            masks = [b.icmp_unsigned("<", b.add(lanes, ir.Constant(i32s, [kw * c.dilation] * wide)),
                                     size) for kw in range(c.kernel)]
        # a few independent sums per output row: one chain of fused multiply-adds would wait
        # on each one's latency
        chains = max(1, min(ACCUMULATORS // len(blk.outs), len(weights)))
        zero = ir.Constant(self.vt, None)
        accs = [[init] + [zero] * (chains - 1) for _ in blk.outs]
        used = [0] * len(blk.outs)
        for i, row in enumerate(blk.inputs):
            for kw in range(c.kernel):
                p = b.gep(row, [b.add(start, k.i64(kw * c.dilation))], source_etype=F32)
                if masked:
                    xs = b.call(masked_intrinsic(k.module, "load", self.wide),
                                [p, ir.Constant(I32, 4), masks[kw], ir.Constant(self.wide, None)])
                else:
                    xs = b.load(p, typ=self.wide, align=4)
                if c.stride > 1:
                    xs = b.shuffle_vector(xs, ir.Constant(self.wide, ir.Undefined), ir.Constant(
                        ir.VectorType(I32, self.width), [j * c.stride for j in range(self.width)]))
                for q, kh in blk.uses[i]:
                    a = used[q] % chains
                    used[q] += 1
                    accs[q][a] = b.call(fmuladd_intrinsic(k.module, self.vt),
                                        [weights[kh * c.kernel + kw], xs, accs[q][a]])
        store_mask = None
        if masked:
            left = splat(b, b.trunc(b.sub(k.dim(c.out), o), I32), self.width)
            store_mask = b.icmp_signed("<", ir.Constant(left.type, list(range(self.width))), left)
        for q, (y, res) in enumerate(blk.outs):
            sums = accs[q]
            while len(sums) > 1:
                sums = [b.fadd(sums[j], sums[j + 1]) if j + 1 < len(sums) else sums[j]
                        for j in range(0, len(sums), 2)]
            acc = sums[0]
            y_p = b.gep(y, [o], source_etype=F32)
            if res is not None:
                acc = b.fadd(acc, self._load(b.gep(res, [o], source_etype=F32), store_mask))
            if self.activation is not None:
                acc = apply_activation(b, self.activation, self.params, acc)
            if store_mask is None:
                b.store(acc, y_p, align=4)
            else:
                b.call(masked_intrinsic(k.module, "store", self.vt),
                       [acc, y_p, ir.Constant(I32, 4), store_mask])

    def _load(self, p: ir.Value, mask: ir.Value | None) -> ir.Value:
        b = self.k.b
        if mask is None:
            return b.load(p, typ=self.vt, align=4)
        return b.call(masked_intrinsic(self.k.module, "load", self.vt),
                      [p, ir.Constant(I32, 4), mask, ir.Constant(self.vt, None)])
