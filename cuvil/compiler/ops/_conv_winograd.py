"""float32 3x3 convolutions (stride 1, dilation 1, one group, 2-D) by Winograd's minimal
filtering F(m x m, 3 x 3): each m x m tile of the output comes from an alpha x alpha tile of
the input (alpha = m + 2) with alpha^2 multiplies per (output, input) channel pair instead of
9 m^2 (4x fewer for m = 4).

    Y_tile = A^T [ sum_c U[., o, c] * V[., c, tile] ] A,   U = G g G^T,   V = B^T d B

The weights' transform U runs once per process, at the library's first run
(`lower_weight_transform`, a derived weight: see codegen/derived.py), into U[alpha^2, M, C]
(one GEMM operand per point): the library keeps the 3x3 kernels, a quarter of U's size for
F(4x4). Transforming per call instead costs too much: the first call takes (1 thread, CPU
time) some 30 ms more than later ones on ResNet-50 (~85 ms a call), 400 ms on VGG-19
(~380 ms); the page faults of U's fresh memory are part of it, but a per-call transform would
still compute and write 4x the weights' bytes every call.
At run time the image is cut into blocks of tile rows, spread over the threads; each block,
in its own part of the scratch memory:

1. transforms its input tiles into V[alpha^2, C, tiles] (B^T d B as a column pass over rows
   staged with their zero padding, then a row pass on whole vectors of tiles),
2. multiplies, per point, U[p] [M, C] @ V[p] [C, tiles] on the shared GEMM kernel,
3. transforms the products back (A^T m A) and writes Y with the node's epilogue (bias,
   residual, activation) applied on the way.

Small images (one block of fewer than `TRANSPOSE_BELOW` tiles: 13x13 and 14x14 have 16 at
F(4x4), 49 at F(2x2)) run the products transposed, prod^T[p] [tiles, M] = V^T[p] [tiles, C]
@ U^T[p] [C, M], so that the output channels fill the kernel's 32 columns; U^T is derived
straight into the kernel's packed-B panels. Their transforms then work on vectors of
channels (`_input_group`, `_output_group`): the input and the output are staged
channels-last through in-register transposes.

An image of fewer blocks than `SPLIT_BELOW` (a 14x14 layer has one) would leave threads idle:
there each step is spread over the threads on its own instead, by (block, input channel or
group of them), (block, point) and (block, output channel or group).

The transform matrices come from the Toom-Cook construction at the points `POINTS` (the
usual 0, +-1, +-2, ... of Lavin & Gray), solved for B^T so that the identity holds exactly.
Rounding grows with m (the points' powers grow): F(4x4) keeps cuvil within the conformance
tolerances on ResNet/VGG. `winograd_tile` chooses F(2x2), F(4x4) or im2col per layer by one
cost rule (`winograd_cost`): F(2x2) rounds less and has a smaller U, which pays where U
streams from memory (512 channels at 14x14 and 7x7) or tiles are few.

In models compiled with precision = "bf16" (docs/precision.md) the F(2x2) convolutions of
small images, whose products run transposed, run them on the bf16 kernel's side "b"
(kernels/bf16_gemm.py; `bf16_products` says which): the compiler rounds U to bf16 once
and the library stores U^T in that kernel's layout, `pack_r` per point
(`bf16_weight_transform`), a little smaller than the 3x3 kernels in float32. CPUs without bf16
instructions widen it at the first run into the float32 kernel's packed layout
(`derive_float32_u`) and run the same algorithm in float32. F(4x4)'s transforms multiply by
larger numbers, which carry bf16's rounding of U and V past the bound: it stays float32, and
the cost rule weighs bf16's cheaper products (`BF16_PRODUCT`) against F(4x4) and against
im2col, which is bf16 in those models.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node
from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.bf16_gemm import (
    K_ALIGN,
    bf16_or_float32,
    emit_bf16_gemm,
    emit_float32_panels,
    pack_r,
    round_up,
)
from cuvil.compiler.kernels.bf16_gemm import PACK_COLS as BF16_PACK_COLS
from cuvil.compiler.kernels.emitter import (
    I1,
    I8,
    I32,
    PTR,
    Emitter,
    masked_intrinsic,
    splat,
    transpose_lanes,
)
from cuvil.compiler.kernels.gemm import PACK_COLS, Epilogue, Layout, emit_gemm
from cuvil.compiler.ops import UNCHECKED, required_input
from cuvil.compiler.ops._window import Window, window
from cuvil.compiler.ops.gemm import BF16_WEIGHTS, RESIDUAL_SLOT, logical_weight, node_epilogue

F32 = ir.FloatType()

#: attribute the `winograd_weights` pass sets on a Conv that runs as Winograd F(m x m, 3 x 3): m
WINOGRAD_TILE = "cuvil.winograd_tile"
#: output tile edges `winograd_tile` chooses from (see the module docstring on accuracy)
TILES = (2, 4)
#: `winograd_cost`'s constants: multiply-adds per transformed element, per float of U that
#: streams from memory, and the floats of U the caches keep from one call to the next. In a
#: model, the other layers' weights and maps pass through the cache between two calls of a
#: layer: a quarter of a 2 MB L2 (1 << 20 floats, fitted to layers timed alone, chose F(4x4)
#: for SqueezeNet's 13x13 layers, whose 2.4 MB U then streamed in: 500 us a call where F(2x2)
#: takes 390, one thread, in the model)
TRANSFORM = 16
STREAM = 16
CACHED = 1 << 17
#: interpolation points of F(m x m, 3 x 3) (alpha - 1 of them; the last point is infinity)
POINTS = {2: (0, 1, -1), 4: (0, 1, -1, 2, -2), 6: (0, 1, -1, 2, -2, 0.5, -0.5)}
#: below these the transforms cost more than the multiplies they save, and the products'
#: rows or columns are too few for the kernel's tiles (measured on ResNet-50's layers,
#: benchmarks/conv_layers.py)
MIN_CHANNELS = 16
MIN_TILES = 16
#: bytes of V and of the products per block: larger blocks give the GEMMs more columns, and
#: each block reads all of U (37 MB for 512 channels): 8 MB blocks took VGG-19's 512-channel
#: 28x28 layers from 1.36 to 0.64 of onnxruntime's time, its 56x56 ones from 0.75 to 0.62
BLOCK_BYTES = 8 << 20
#: images of fewer blocks spread each step over the threads, not the blocks (2 threads and
#: 2 or 3 blocks leave a thread idle part of the time)
SPLIT_BELOW = 4
#: blocks of fewer tiles run their products transposed (`transposed_products`)
TRANSPOSE_BELOW = 64
#: the transposed products' transforms work on groups of this many channels (vectors of the
#: target's width inside): V^T's and prod^T's rows are padded to whole groups
GROUP = 16
#: bytes of staged rows a thread may keep on its stack
MAX_STACK_STAGE = 32 << 10
#: attribute passes/winograd_weights.py sets where the model's transformed-weights setting is
#: "library": U computed by the compiler and stored in the library (`weight_transform`), else
#: derived at the first run from the 3x3 kernels the library keeps (`lower_weight_transform`).
#: Stored, the first run writes no fresh memory for U (fresh memory cost ~1 ms per MB on a
#: virtual machine; ResNet-50's U is 30 MB), but the library grows by U - kernels (ResNet-50
#: 101 -> 116 MB, VGG-19 160 -> 313 MB; incompressible for real weights)
U_STORED = "cuvil.winograd_u_stored"
#: lanes a transform handles at once is the target's vector width; buffers are padded for
#: the widest (AVX-512)
MAX_LANES = 16
#: bf16 models: the tile whose products run in bf16 (module docstring), and the cost of a
#: multiply-add on the bf16 kernel relative to the float32 kernel's, for `winograd_cost`
#: (ResNet-50's products on a Zen 4 with AVX-512 BF16: 155-200 GFLOP/s against 105-115)
BF16_TILE = 2
BF16_PRODUCT = 0.6


@functools.cache
def transforms(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T [m, alpha], G [alpha, 3], B^T [alpha, alpha]) of F(m, 3) in float64."""
    pts = POINTS[m]
    alpha = m + 2
    at = np.zeros((m, alpha))
    g = np.zeros((alpha, 3))
    for j, p in enumerate(pts):
        at[:, j] = [p ** i for i in range(m)]
        g[j] = [p ** k / np.prod([p - q for q in pts if q != p]) for k in range(3)]
    at[m - 1, alpha - 1] = g[alpha - 1, 2] = 1.0
    # B^T solves sum_j A^T[i, j] G[j, k] B^T[j, l] = [l == i + k] for every i, k, l
    eqs, rhs = [], []
    for i in range(m):
        for k in range(3):
            for col in range(alpha):
                eq = np.zeros((alpha, alpha))
                eq[:, col] = at[i] * g[:, k]
                eqs.append(eq.ravel())
                rhs.append(float(col == i + k))
    bt, *_ = np.linalg.lstsq(np.array(eqs), np.array(rhs), rcond=None)
    # the exact solution has short binary fractions: drop lstsq's rounding noise
    return at, g, np.round(bt.reshape(alpha, alpha), 9)


def winograd_tile(node: Node, precision: str = "float32") -> int | None:
    """The tile edge m when this Conv runs as Winograd F(m x m, 3 x 3), else None (im2col).

    It must be 2-D float32 with a constant 3x3 weight, unit strides and dilations, one group,
    a static image (the batch may be symbolic) and enough channels and tiles to pay back the
    transforms; m is the tile `winograd_cost` finds cheapest, if cheaper than im2col. In a
    model of `precision` "bf16", im2col's products run in bf16, and some F(2x2) ones
    (`bf16_products`)."""
    x, w = node.input(0), node.input(1)
    if (node.op_type != "Conv" or node.domain or x is None or w is None or w.const is None
            or WINOGRAD_TILE in node.attrs or x.type.dtype.name != "float32"
            or x.type.rank != 4 or tuple(w.type.shape[2:]) != (3, 3)
            or int(node.attrs.get("group", 1)) != 1
            or not all(isinstance(d, int) for d in x.type.shape[1:])):
        return None
    win = window(node, UNCHECKED, x.type.shape[2:], (3, 3))
    if win.strides != (1, 1) or win.dilations != (1, 1) \
            or not all(isinstance(d, int) for d in (*win.out, *win.pads_begin)):
        return None
    m_out, c_in = (int(d) for d in w.type.shape[:2])
    if min(m_out, c_in) < MIN_CHANNELS:
        return None
    oh, ow = (int(d) for d in win.out)
    bf16 = precision == "bf16"
    costs = {m: winograd_cost(m, c_in, m_out, oh, ow,
                              bf16=bf16 and bf16_products(m, c_in, m_out, oh, ow))
             for m in TILES if _ceil(oh, m) * _ceil(ow, m) >= MIN_TILES}
    im2col = 9 * oh * ow * c_in * m_out * (BF16_PRODUCT if bf16 else 1)
    if not costs or min(costs.values()) >= im2col:
        return None
    return min(costs, key=lambda m: costs[m])


def winograd_cost(m: int, c: int, out_c: int, oh: int, ow: int, bf16: bool = False) -> float:
    """The cost rule that chooses between im2col and Winograd F(m x m, 3 x 3), per image, in
    multiply-adds (im2col's are 9 oh ow C M; its packed weights stay cached):

        alpha^2 T (C M + TRANSFORM (C + M)) + STREAM max(0, alpha^2 C M - CACHED) blocks

    for T tiles: the point products, the transforms (per element of V and of the products),
    and U's floats beyond what the caches keep from one call of the layer to the next in a
    model (CACHED), which stream from memory at every call and
    for every block of tiles (see `_Plan`), each used only T times: U is 37 MB for a layer
    of 512 channels at F(4x4), 16 MB at F(2x2), which makes more products than F(4x4) but a
    U 2.25x smaller. The constants are fitted to layers of
    ResNet-50, VGG-19, SqueezeNet and Inception v2 at 7x7 to 28x28 (benchmarks/conv_layers.py
    --small, one thread of a server core with 2 MB of L2). `bf16`: the products run on the
    bf16 kernel (`BF16_PRODUCT`) and U is bf16, half the bytes to stream."""
    alpha = m + 2
    tiles = _ceil(oh, m) * _ceil(ow, m)
    u_words = alpha * alpha * c * out_c // (2 if bf16 else 1)  # in floats' bytes
    blocks = _ceil(tiles * alpha * alpha * (c + out_c) * 4, BLOCK_BYTES)  # each reads U
    product = BF16_PRODUCT if bf16 else 1
    return (alpha * alpha * tiles * (c * out_c * product + TRANSFORM * (c + out_c))
            + STREAM * max(0, u_words - CACHED) * blocks)


def transposed_products(tiles: int, blocks: int, out_c: int) -> bool:
    """Whether a block's per-point products run transposed, prod^T [tiles, M] = V^T [tiles, C]
    @ U^T [C, M]: with the tiles as columns, fewer than `TRANSPOSE_BELOW` of them leave most
    of the kernel's 32-column tile masked off (13x13 and 14x14 images have 16 tiles, 7x7
    ones 4 or 16); the output channels fill it instead. Only for images of one block: with
    more (56x56 images of 256 channels have blocks of 28 tiles), U's reads repeat per block
    and the untransposed products were faster (0.68 vs 0.81 of onnxruntime's time)."""
    return tiles < TRANSPOSE_BELOW and blocks == 1 and out_c >= tiles


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _blocking(m: int, c: int, out_c: int, oh: int, ow: int) -> tuple[int, int]:
    """(tile rows per block, blocks) of F(m x m) on an oh x ow output: blocks of about
    BLOCK_BYTES of V and products, in whole rows of tiles."""
    tiles_h, tiles_w = _ceil(oh, m), _ceil(ow, m)
    per_tile = (m + 2) ** 2 * (c + out_c) * 4
    rows = min(tiles_h, _ceil(max(1, BLOCK_BYTES // per_tile), tiles_w))
    return rows, _ceil(tiles_h, rows)


def bf16_products(m: int, c: int, out_c: int, oh: int, ow: int) -> bool:
    """Whether a bf16 model runs the point products of F(m x m) in bf16: F(2x2) whose products
    run transposed (images of one block of few tiles; the bf16 kernel's side "b"). Not F(4x4),
    which rounds too much (module docstring), nor untransposed products (the kernel's side "a",
    which packs V per call): those ran slower than float32 F(4x4), ResNet-50's 128-channel
    28x28 layers 0.78 -> 0.88-0.98 ms, VGG-19's 512-channel ones 11.0 -> 13.2 ms (one thread,
    a Zen 4, `cuvil bench --profile`)."""
    if m != BF16_TILE:
        return False
    rows, blocks = _blocking(m, c, out_c, oh, ow)
    return transposed_products(rows * _ceil(ow, m), blocks, out_c)


def runs_in_bf16(node: Node) -> bool:
    """Whether a Winograd conv of a bf16 model runs its products in bf16 (`bf16_products`)."""
    plan = _plan_of(node)
    return bf16_products(plan.m, plan.c, plan.out_c, plan.oh, plan.ow)


class _Plan:
    """The static geometry of one node's Winograd convolution."""

    def __init__(self, node: Node, win: Window) -> None:
        x = node.inputs[0]
        w = logical_weight(node)
        assert x is not None
        self.m = m = int(node.attrs[WINOGRAD_TILE])
        #: U is bf16 (`bf16_weight_transform`)
        self.bf16 = BF16_WEIGHTS in node.attrs
        self.alpha = alpha = m + 2
        self.points = alpha * alpha
        self.c, self.h, self.w = (int(d) for d in x.type.shape[1:])
        self.out_c = int(w.type.shape[0])
        self.oh, self.ow = (int(d) for d in win.out)
        self.pad_top, self.pad_left = (int(d) for d in win.pads_begin)
        self.tiles_h, self.tiles_w = _ceil(self.oh, m), _ceil(self.ow, m)
        # a staged row: the image row at pad_left, zeros around, long enough for whole vectors
        self.row = _ceil(self.tiles_w, MAX_LANES) * MAX_LANES * m + alpha - m
        self.block_rows, self.blocks = _blocking(m, self.c, self.out_c, self.oh, self.ow)
        self.block_tiles = tiles = self.block_rows * self.tiles_w
        self.transposed = transposed_products(tiles, self.blocks, self.out_c)
        if self.transposed:
            # V^T[p, tile, c] and prod^T[p, tile, o], channels padded to whole groups; the
            # block's input staged channels-last (sh x sw pixels, padding included), and its
            # output too (oh_blk x ow_blk), in the same place
            self.cp = _ceil(self.c, GROUP) * GROUP
            self.ld = _ceil(self.out_c, GROUP) * GROUP
            self.v_floats = self.points * tiles * self.cp
            self.prod_floats = self.points * tiles * self.ld
            self.sh, self.sw = self.block_rows * m + alpha - m, self.tiles_w * m + alpha - m
            self.yw = self.tiles_w * m
            self.stage_floats = max(self.sh * self.sw * self.cp,
                                    self.block_rows * m * self.yw * self.ld)
        else:
            # V[p, c, tile] and prod[p, o, tile]: vector reads past the last tile stay inside
            self.ld = _ceil(tiles + MAX_LANES, 16) * 16
            self.v_floats = self.points * self.c * self.ld
            self.prod_floats = self.points * self.out_c * self.ld
            self.stage_floats = 2 * alpha * self.row  # the staged rows, their column pass
        # few blocks would leave threads idle: split each step over the threads instead (the
        # untransposed input transform stages rows on the stack: small images only)
        self.split = self.blocks < SPLIT_BELOW and (
            self.transposed or self.stage_floats * 4 <= MAX_STACK_STAGE)
        on_stack = self.split and not self.transposed
        in_block = self.v_floats + self.prod_floats + (0 if on_stack else self.stage_floats)
        self.block_floats = _ceil(in_block, 16) * 16

    @property
    def scratch_bytes(self) -> int:
        return self.blocks * self.block_floats * 4


def _plan_of(node: Node) -> _Plan:
    x = node.inputs[0]
    assert x is not None
    return _Plan(node, window(node, UNCHECKED, x.type.shape[2:], (3, 3)))


def scratch_bytes(node: Node, win: Window) -> Dim:
    return _Plan(node, win).scratch_bytes


def weight_bytes(node: Node) -> int:
    """Bytes of U[alpha^2, M, C] in float32 for a node `winograd_tile` chose (for bf16 U, of
    the float32 copy CPUs without bf16 instructions derive)."""
    w = logical_weight(node)
    alpha = int(node.attrs[WINOGRAD_TILE]) + 2
    return alpha * alpha * int(w.type.shape[0]) * int(w.type.shape[1]) * 4


def _u(node: Node) -> np.ndarray:
    """U[alpha^2, M, C] = G w G^T per (o, c), in float64."""
    w_val = node.inputs[1]
    assert w_val is not None and w_val.const is not None
    w = np.asarray(w_val.const, dtype=np.float64)
    m_out, c_in = w.shape[:2]
    alpha = int(node.attrs[WINOGRAD_TILE]) + 2
    _, g, _ = transforms(alpha - 2)
    # u[a, b, o, c] = sum_j,l G[a, j] w[o, c, j, l] G[b, l]
    u: np.ndarray = np.einsum("aj,ocjl,bl->aboc", g, w, g)
    return u.reshape(alpha * alpha, m_out, c_in)


def bf16_weight_transform(node: Node) -> np.ndarray:
    """U rounded to bf16 (from float64 through float32; both round to nearest) for a node that
    `runs_in_bf16`: `pack_r` of U^T[p] [C, M] per point, the bf16 kernel's side "b". The library
    stores it instead of the 3x3 kernels (32 bytes per channel pair, the kernels' float32 36)."""
    assert runs_in_bf16(node)
    return np.stack([pack_r(up.T) for up in _u(node).astype(np.float32)])


def weight_transform(node: Node) -> np.ndarray:
    """U as `lower_weight_transform` lays it out, computed by the compiler (float64, rounded
    once to float32): the library stores it instead of the 3x3 kernels."""
    u = _u(node).astype(np.float32)
    points, m_out, _ = u.shape
    if not _plan_of(node).transposed:
        return u
    # U^T[p] [C, M] as the kernel's pre-packed B: panels of PACK_COLS output channels, c-major
    panels = [u[:, o:o + PACK_COLS, :].transpose(0, 2, 1).reshape(points, -1)
              for o in range(0, m_out, PACK_COLS)]
    return np.ascontiguousarray(np.concatenate(panels, axis=1))


def stored_weight_transform(node: Node) -> np.ndarray | None:
    """U for the library to store, where the node is marked `U_STORED` (else None: derived)."""
    return weight_transform(node) if U_STORED in node.attrs else None


def lower_weight_transform(node: Node, k: Emitter) -> None:
    """U[(a, b), o, c] = (G w[o, c] G^T)[a, b] into `k.derived`, in float64 like the
    transforms' coefficients (1/6, 1/24... are not float32 numbers), parallel over o."""
    w_val = node.inputs[1]
    assert w_val is not None and k.derived is not None
    m_out, c_in = int(w_val.type.shape[0]), int(w_val.type.shape[1])
    alpha = int(node.attrs[WINOGRAD_TILE]) + 2
    _, g, _ = transforms(alpha - 2)
    transposed = _plan_of(node).transposed
    f64 = ir.DoubleType()
    with k.parallel_loop(m_out, cost=c_in * 4 * alpha * alpha, name="wt",
                         carry=[k.derived]) as o:
        (u,) = k.carried
        w = k.buffers[w_val]
        b = k.b
        if transposed:
            # U^T[p] [C, M] as the kernel's pre-packed B (`pack_b`): panels of PACK_COLS
            # output channels, each c-major
            base = b.mul(b.udiv(o, k.i64(PACK_COLS)), k.i64(PACK_COLS))
            width = k.minimum("int64", b.sub(k.i64(m_out), base), k.i64(PACK_COLS))
            o_at = b.add(b.mul(base, k.i64(c_in)), b.sub(o, base))
        with k.loop(c_in, name="c") as c:
            pair = b.add(b.mul(o, k.i64(c_in)), c)
            at = b.add(o_at, b.mul(c, width)) if transposed else pair
            taps = [b.fpext(b.load(b.gep(w, [b.add(b.mul(pair, k.i64(9)), k.i64(i))],
                                         source_etype=F32), typ=F32), f64) for i in range(9)]
            # t = G w: t[a][l] = sum_j G[a, j] w[j, l]; then U[a][b] = sum_l t[a][l] G[b, l]
            t = [[_combine(b, g[a], [taps[3 * j + col] for j in range(3)]) for col in range(3)]
                 for a in range(alpha)]
            for a in range(alpha):
                for bb in range(alpha):
                    off = b.add(k.i64((a * alpha + bb) * m_out * c_in), at)
                    b.store(b.fptrunc(_combine(b, g[bb], t[a]), F32),
                            b.gep(u, [off], source_etype=F32))


def derive_float32_u(node: Node, k: Emitter) -> None:
    """bf16 U, on CPUs that run its float32 path: U^T widened into `k.derived` as the float32
    kernel's `pack_b` per point, the layout of float32 U^T (`weight_transform`)."""
    plan = _plan_of(node)
    assert k.derived is not None
    emit_float32_panels(k, "b", k.buffers[required_input(node, 1)], k.derived, plan.c,
                        plan.out_c, plan.points)


def lower_conv_winograd(node: Node, k: Emitter, win: Window) -> None:
    """float32 U: from `k.derived`; bf16 U: the node's weight, on the bf16 kernel where the
    CPU has bf16 instructions, else its float32 copy in `k.derived` (`derive_float32_u`)."""
    plan = _Plan(node, win)
    derived = k.derived
    assert derived is not None
    if not plan.bf16:
        _lower_conv_winograd(node, k, plan, derived, False)
        return
    w_ptr = k.buffers[required_input(node, 1)]
    bf16_or_float32(k, lambda: _lower_conv_winograd(node, k, plan, w_ptr, True),
                    lambda: _lower_conv_winograd(node, k, plan, derived, False))


def _lower_conv_winograd(node: Node, k: Emitter, plan: _Plan, u: ir.Value, bf16: bool) -> None:
    x_val, b_val = node.inputs[0], node.input(2)
    assert x_val is not None and k.scratch is not None
    r_val = node.input(RESIDUAL_SLOT)
    b = k.b
    null = ir.Constant(PTR, None)
    x_ptr, y_ptr = k.buffers[x_val], k.buffers[node.outputs[0]]
    with k.loop(k.dim(x_val.type.shape[0]), name="n") as n:
        x_n = b.gep(x_ptr, [b.mul(n, k.i64(plan.c * plan.h * plan.w))], source_etype=F32)
        y_off = b.mul(n, k.i64(plan.out_c * plan.oh * plan.ow))
        y_n = b.gep(y_ptr, [y_off], source_etype=F32)
        r_n = b.gep(k.buffers[r_val], [y_off], source_etype=F32) if r_val is not None else null
        bias = k.buffers[b_val] if b_val is not None else null
        carry = [x_n, y_n, r_n, bias, u, k.scratch]
        if plan.split:
            _split_image(node, k, plan, carry, bf16)
        else:
            _blocks_image(node, k, plan, carry, bf16)


class _Block:
    """Where block `t`'s V, products and staged rows are, and which tile rows it has."""

    def __init__(self, k: Emitter, plan: _Plan, scratch: ir.Value, t: ir.Value) -> None:
        b = k.b
        self.v = b.gep(scratch, [b.mul(t, k.i64(plan.block_floats))], source_etype=F32)
        self.prod = b.gep(self.v, [k.i64(plan.v_floats)], source_etype=F32)
        self.stage = b.gep(self.v, [k.i64(plan.v_floats + plan.prod_floats)], source_etype=F32)
        self.first = b.mul(t, k.i64(plan.block_rows))
        self.rows = k.minimum("int64", b.sub(k.i64(plan.tiles_h), self.first),
                              k.i64(plan.block_rows))
        self.tiles = b.mul(self.rows, k.i64(plan.tiles_w))


def _blocks_image(node: Node, k: Emitter, plan: _Plan, carry: list[ir.Value],
                  bf16: bool) -> None:
    """One image, its blocks spread over the threads: each block's V and products stay in
    its thread's cache from one step to the next."""
    has_bias, has_residual = node.input(2) is not None, node.input(RESIDUAL_SLOT) is not None
    cost = plan.block_rows * plan.tiles_w * plan.points * plan.c * plan.out_c
    with k.parallel_loop(plan.blocks, cost=cost, name="wblock", carry=carry) as t:
        x_c, y_c, r_c, bias_c, u_c, scratch = k.carried
        blk = _Block(k, plan, scratch, t)
        bias, residual = bias_c if has_bias else None, r_c if has_residual else None
        if plan.transposed:
            with k.loop(plan.cp // GROUP, name="cg") as g:
                _input_group(k, plan, x_c, blk, g)
        else:
            _input_transform(k, plan, x_c, blk, blk.stage, (k.i64(0), k.i64(plan.c)))
        with k.loop(plan.points, name="pt") as p:
            _point_gemm(k, plan, u_c, blk, p, bf16)
        if plan.transposed:
            with k.loop(plan.ld // GROUP, name="og") as g:
                _output_group(k, plan, blk, y_c, bias, residual, node_epilogue(node), g)
        else:
            _output_transform(k, plan, blk, y_c, bias_c if has_bias else None,
                              r_c if has_residual else None, node_epilogue(node),
                              (k.i64(0), k.i64(plan.out_c)))


def _split_image(node: Node, k: Emitter, plan: _Plan, carry: list[ir.Value],
                 bf16: bool) -> None:
    """One image of few blocks, each step spread over the threads on its own: the input
    transform by (block, channel or group of channels), the products by (block, point), the
    output transform by (block, output channel or group). Costs two more hand-overs between
    threads than `_blocks_image`, and V and the products move between the threads' caches."""
    has_bias, has_residual = node.input(2) is not None, node.input(RESIDUAL_SLOT) is not None
    tiles = plan.block_rows * plan.tiles_w
    c, out_c = plan.c, plan.out_c
    # the transposed products' transforms take a group of channels at once
    in_parts = plan.cp // GROUP if plan.transposed else c
    with k.parallel_loop(plan.blocks * in_parts, cost=tiles * plan.points * 4 * c // in_parts,
                         name="win", carry=carry) as i:
        x_c, _, _, _, _, scratch = k.carried
        blk = _Block(k, plan, scratch, k.b.udiv(i, k.i64(in_parts)))
        part = k.b.urem(i, k.i64(in_parts))
        if plan.transposed:
            _input_group(k, plan, x_c, blk, part)
        else:
            with k.b.goto_block(k.function.entry_basic_block):
                stage = k.b.alloca(F32, size=k.i64(plan.stage_floats), name="stage")
            _input_transform(k, plan, x_c, blk, stage, (part, k.b.add(part, k.i64(1))))
    with k.parallel_loop(plan.blocks * plan.points, cost=tiles * c * out_c, name="wgemm",
                         carry=carry) as i:
        _, _, _, _, u_c, scratch = k.carried
        blk = _Block(k, plan, scratch, k.b.udiv(i, k.i64(plan.points)))
        _point_gemm(k, plan, u_c, blk, k.b.urem(i, k.i64(plan.points)), bf16)
    out_parts = plan.ld // GROUP if plan.transposed else out_c
    with k.parallel_loop(plan.blocks * out_parts,
                         cost=tiles * plan.points * 4 * out_c // out_parts, name="wout",
                         carry=carry) as i:
        _, y_c, r_c, bias_c, _, scratch = k.carried
        blk = _Block(k, plan, scratch, k.b.udiv(i, k.i64(out_parts)))
        part = k.b.urem(i, k.i64(out_parts))
        bias, residual = bias_c if has_bias else None, r_c if has_residual else None
        if plan.transposed:
            _output_group(k, plan, blk, y_c, bias, residual, node_epilogue(node), part)
        else:
            _output_transform(k, plan, blk, y_c, bias, residual, node_epilogue(node),
                              (part, k.b.add(part, k.i64(1))))


def _point_gemm(k: Emitter, plan: _Plan, u: ir.Value, blk: _Block, p: ir.Value,
                bf16: bool) -> None:
    """The block's products at point p: prod[p] [M, tiles] = U[p] [M, C] @ V[p] [C, tiles],
    or transposed, prod^T[p] [tiles, M] = V^T[p] [tiles, C] @ U^T[p] [C, M] (U^T pre-packed;
    `bf16`: on the bf16 kernel, U^T bf16, `bf16_weight_transform`)."""
    b = k.b
    m_out, c = k.i64(plan.out_c), k.i64(plan.c)
    if plan.transposed:
        tiles = plan.block_tiles
        v = b.gep(blk.v, [b.mul(p, k.i64(tiles * plan.cp))], source_etype=F32)
        prod = b.gep(blk.prod, [b.mul(p, k.i64(tiles * plan.ld))], source_etype=F32)
        if bf16:  # pack_r per point: panels of 32 columns, K padded
            u_p = round_up(plan.out_c, BF16_PACK_COLS) * round_up(plan.c, K_ALIGN) * 2
            emit_bf16_gemm(k, blk.tiles, m_out, c, v, k.i64(plan.cp),
                           b.gep(u, [b.mul(p, k.i64(u_p))], source_etype=I8), k.i64(0),
                           prod, k.i64(plan.ld), side="b")
            return
        emit_gemm(k, blk.tiles, m_out, c, v, k.i64(plan.cp),
                  b.gep(u, [b.mul(p, k.i64(plan.out_c * plan.c))], source_etype=F32), m_out,
                  prod, k.i64(plan.ld), layout=Layout(packed_b=True))
        return
    emit_gemm(k, m_out, blk.tiles, c,
              b.gep(u, [b.mul(p, k.i64(plan.out_c * plan.c))], source_etype=F32), c,
              b.gep(blk.v, [b.mul(p, k.i64(plan.c * plan.ld))], source_etype=F32),
              k.i64(plan.ld),
              b.gep(blk.prod, [b.mul(p, k.i64(plan.out_c * plan.ld))], source_etype=F32),
              k.i64(plan.ld))


# -- the transforms --------------------------------------------------------------------------


def _combine(b: ir.IRBuilder, coefs: np.ndarray, xs: list[ir.Value]) -> ir.Value:
    """sum_i coefs[i] * xs[i] with the constant coefficients folded in (zeros skipped, ones
    added); at least one coefficient is non-zero."""
    acc: ir.Value | None = None
    for c, x in zip(coefs, xs):
        c = float(c)
        if c == 0.0:
            continue
        if abs(c) == 1.0:
            term, negative = x, c < 0
        else:
            term, negative = b.fmul(x, _splat_const(x.type, abs(c))), c < 0
            term.flags.append("contract")
        if acc is None:
            acc = b.fsub(_splat_const(x.type, 0.0), term) if negative else term
        else:
            acc = b.fsub(acc, term) if negative else b.fadd(acc, term)
            acc.flags.append("contract")
    assert acc is not None
    return acc


def _splat_const(ty: ir.Type, value: float) -> ir.Constant:
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
    return ir.Constant(ty, value)


def _lanes(k: Emitter) -> int:
    return min(k.target.isa.vector, MAX_LANES)


def _groups(plan: _Plan, lanes: int) -> tuple[int, int]:
    """(vector groups of tiles along a tile row, tiles in the last one)."""
    groups = _ceil(plan.tiles_w, lanes)
    return groups, plan.tiles_w - (groups - 1) * lanes


def _input_transform(k: Emitter, plan: _Plan, x: ir.Value, blk: _Block, stage: ir.Value,
                     channels: tuple[ir.Value, ir.Value]) -> None:
    """V[p = (xi, nu), c, tile] = (B^T d B)[xi, nu] for the block's tiles: per channel and tile
    row, the alpha input rows are staged with their padding, transformed down the columns
    (tmp = B^T rows, vectorized along the row), then across (tmp B, on vectors of tiles)."""
    b = k.b
    _, _, bt = transforms(plan.m)
    alpha, m, row = plan.alpha, plan.m, plan.row
    tmp = b.gep(stage, [k.i64(alpha * row)], source_etype=F32)
    lanes = _lanes(k)
    groups, tail = _groups(plan, lanes)
    v, first = blk.v, blk.first
    with k.loop(channels[1], start=channels[0], name="c") as c, \
            k.loop(blk.rows, name="ti") as i:
        top = b.sub(b.mul(b.add(first, i), k.i64(m)), k.i64(plan.pad_top))
        for r in range(alpha):
            dst = b.gep(stage, [k.i64(r * row)], source_etype=F32)
            y = b.add(top, k.i64(r))
            inside = b.and_(b.icmp_signed(">=", y, k.i64(0)), b.icmp_signed("<", y, k.i64(plan.h)))
            k.memset(dst, 0, k.i64(row * 4))
            with k.if_then(inside):
                src = b.gep(x, [b.add(b.mul(c, k.i64(plan.h * plan.w)), b.mul(y, k.i64(plan.w)))],
                            source_etype=F32)
                k.memcpy(b.gep(dst, [k.i64(plan.pad_left)], source_etype=F32), src,
                         k.i64(plan.w * 4))
        with k.loop(row, name="col") as col:
            d = [b.load(b.gep(stage, [b.add(col, k.i64(r * row))], source_etype=F32), typ=F32)
                 for r in range(alpha)]
            for xi in range(alpha):
                b.store(_combine(b, bt[xi], d), b.gep(tmp, [b.add(col, k.i64(xi * row))],
                                                      source_etype=F32))
        tile0 = b.mul(i, k.i64(plan.tiles_w))
        c_off = b.mul(c, k.i64(plan.ld))

        def group(g: ir.Value, valid: int) -> None:
            # lane l of d[s] is tmp[xi, (g*lanes + l)*m + s]: one wide load, then shuffles
            span = lanes * m + alpha - m
            t = b.add(tile0, b.mul(g, k.i64(lanes)))
            for xi in range(alpha):
                src = b.gep(tmp, [b.add(k.i64(xi * row), b.mul(g, k.i64(lanes * m)))],
                            source_etype=F32)
                wide = b.load(src, typ=ir.VectorType(F32, span), align=4)
                d = [b.shuffle_vector(wide, ir.Constant(wide.type, ir.Undefined),
                                      _indices([lane * m + s for lane in range(lanes)]))
                     for s in range(alpha)]
                for nu in range(alpha):
                    off = b.add(b.add(k.i64((xi * alpha + nu) * plan.c * plan.ld), c_off), t)
                    _store(k, _combine(b, bt[nu], d), b.gep(v, [off], source_etype=F32),
                           _mask(lanes, valid))

        with k.loop(groups - 1, name="tg") as g:
            group(g, lanes)
        group(k.i64(groups - 1), tail)


def _output_transform(k: Emitter, plan: _Plan, blk: _Block, y: ir.Value,
                      bias: ir.Value | None, residual: ir.Value | None, epilogue: Epilogue,
                      channels: tuple[ir.Value, ir.Value]) -> None:
    """Y[o, tile] = act(A^T m A + bias + residual) for the block's tiles, on vectors of tiles
    along a tile row; the m output rows of a vector of tiles are interleaved in registers and
    stored as whole rows (the last columns and rows of the image masked or skipped)."""
    b = k.b
    at, _, _ = transforms(plan.m)
    alpha, m = plan.alpha, plan.m
    lanes = _lanes(k)
    groups, _ = _groups(plan, lanes)
    width = lanes * m
    wide_t = ir.VectorType(F32, width)
    plane = plan.oh * plan.ow
    prod, first = blk.prod, blk.first
    with k.loop(channels[1], start=channels[0], name="o") as o, \
            k.loop(blk.rows, name="to") as i:
        gi = b.add(first, i)
        tile0 = b.mul(i, k.i64(plan.tiles_w))
        shift = None
        if bias is not None:
            bv = b.load(b.gep(bias, [o], source_etype=F32), typ=F32)
            shift = splat(b, bv, width)

        def group(g: ir.Value, mask: ir.Value | None) -> None:
            t = b.add(tile0, b.mul(g, k.i64(lanes)))
            half = []  # half[xi][s] = sum_nu prod[(xi, nu)] A[nu, s]
            for xi in range(alpha):
                vals = []
                for nu in range(alpha):
                    off = b.add(k.i64((xi * alpha + nu) * plan.out_c * plan.ld),
                                b.add(b.mul(o, k.i64(plan.ld)), t))
                    vals.append(b.load(b.gep(prod, [off], source_etype=F32),
                                       typ=ir.VectorType(F32, lanes), align=4))
                half.append([_combine(b, at[s], vals) for s in range(m)])
            for r in range(m):
                out = [_combine(b, at[r], [half[xi][s] for xi in range(alpha)]) for s in range(m)]
                # row r of the lanes' tiles, in image order: lane l's m values side by side
                line = _interleave(b, out)
                oy = b.add(b.mul(gi, k.i64(m)), k.i64(r))
                with k.if_then(b.icmp_signed("<", oy, k.i64(plan.oh))):
                    off = b.add(b.add(b.mul(o, k.i64(plane)), b.mul(oy, k.i64(plan.ow))),
                                b.mul(g, k.i64(width)))
                    if shift is not None:
                        line = b.fadd(line, shift)
                    if residual is not None:
                        line = b.fadd(line, _load(k, wide_t, b.gep(residual, [off],
                                                                  source_etype=F32), mask))
                    if epilogue.activation is not None:
                        line = apply_activation(b, epilogue.activation, epilogue.params, line)
                    _store(k, line, b.gep(y, [off], source_etype=F32), mask)

        with k.loop(groups - 1, name="og") as g:
            group(g, None)
        group(k.i64(groups - 1), _mask(width, plan.ow - (groups - 1) * width))


def _input_group(k: Emitter, plan: _Plan, x: ir.Value, blk: _Block, g: ir.Value) -> None:
    """V^T[p, tile, c] for the block's tiles and the GROUP channels from g * GROUP, on vectors
    of channels: the block's input rows are first staged channels-last with their zero padding
    (channels past C are zeros too), then each tile's alpha x alpha pixels are transformed
    (B^T d B, down the columns then across) and stored as whole vectors."""
    b = k.b
    _, _, bt = transforms(plan.m)
    alpha, m, cp, sw = plan.alpha, plan.m, plan.cp, plan.sw
    lanes = _lanes(k)
    vt = ir.VectorType(F32, lanes)
    stage, c0 = blk.stage, b.mul(g, k.i64(GROUP))
    top = b.sub(b.mul(blk.first, k.i64(m)), k.i64(plan.pad_top))
    zero = ir.Constant(vt, None)
    with k.loop(GROUP // lanes, name="cv") as cv, \
            k.loop(b.add(b.mul(blk.rows, k.i64(m)), k.i64(alpha - m)), name="sy") as sy:
        c = b.add(c0, b.mul(cv, k.i64(lanes)))
        y = b.add(top, sy)
        dst = b.gep(stage, [b.add(b.mul(b.mul(sy, k.i64(sw)), k.i64(cp)), c)], source_etype=F32)

        def put(sx: int, vec: ir.Value) -> None:
            b.store(vec, b.gep(dst, [k.i64(sx * cp)], source_etype=F32), align=4)

        for sx in (*range(plan.pad_left), *range(plan.pad_left + plan.w, sw)):
            put(sx, zero)
        inside = b.and_(b.icmp_signed(">=", y, k.i64(0)), b.icmp_signed("<", y, k.i64(plan.h)))
        with b.if_else(inside) as (row, padding):
            with row:
                # lanes channels x lanes pixels at a time, transposed in registers
                for x0 in range(0, plan.w, lanes):
                    valid = min(lanes, plan.w - x0)
                    rows = []
                    for i in range(lanes):
                        ch = b.add(c, k.i64(i))
                        # channels past C read channel C - 1's row and keep zeros
                        src = b.gep(x, [b.add(b.mul(k.minimum("int64", ch, k.i64(plan.c - 1)),
                                                    k.i64(plan.h * plan.w)),
                                              b.add(b.mul(y, k.i64(plan.w)), k.i64(x0)))],
                                    source_etype=F32)
                        rows.append(b.select(b.icmp_signed("<", ch, k.i64(plan.c)),
                                             _load(k, vt, src, _mask(lanes, valid)), zero))
                    for j, col in enumerate(transpose_lanes(b, rows)[:valid]):
                        put(plan.pad_left + x0 + j, col)
            with padding:
                for sx in range(plan.pad_left, plan.pad_left + plan.w):
                    put(sx, zero)
    with k.loop(blk.rows, name="ti") as ti, k.loop(plan.tiles_w, name="tj") as tj, \
            k.loop(GROUP // lanes, name="cv") as cv:
        c = b.add(c0, b.mul(cv, k.i64(lanes)))
        corner = b.add(b.mul(b.mul(ti, k.i64(m)), k.i64(sw)), b.mul(tj, k.i64(m)))
        d = [[b.load(b.gep(stage, [b.add(b.mul(b.add(corner, k.i64(r * sw + col)), k.i64(cp)),
                                         c)], source_etype=F32), typ=vt, align=4)
              for col in range(alpha)] for r in range(alpha)]
        tmp = [[_combine(b, bt[xi], [d[r][col] for r in range(alpha)]) for col in range(alpha)]
               for xi in range(alpha)]
        t = b.add(b.mul(ti, k.i64(plan.tiles_w)), tj)
        at_t = b.add(b.mul(t, k.i64(cp)), c)
        for xi in range(alpha):
            for nu in range(alpha):
                off = b.add(k.i64((xi * alpha + nu) * plan.block_tiles * cp), at_t)
                b.store(_combine(b, bt[nu], tmp[xi]), b.gep(blk.v, [off], source_etype=F32),
                        align=4)


def _output_group(k: Emitter, plan: _Plan, blk: _Block, y: ir.Value, bias: ir.Value | None,
                  residual: ir.Value | None, epilogue: Epilogue, g: ir.Value) -> None:
    """Y for the GROUP output channels from g * GROUP from the transposed products
    (prod^T[p, tile, o]): each tile's A^T m A on vectors of channels (with the bias, and the
    activation when no residual comes after it) into the block's output staged
    channels-last, then copied to Y's planes (adding the residual, then the activation)."""
    b = k.b
    at, _, _ = transforms(plan.m)
    alpha, m, ld, yw = plan.alpha, plan.m, plan.ld, plan.yw
    lanes = _lanes(k)
    vt = ir.VectorType(F32, lanes)
    stage, o0 = blk.stage, b.mul(g, k.i64(GROUP))
    iota = ir.Constant(ir.VectorType(I32, lanes), list(range(lanes)))
    with k.loop(blk.rows, name="ti") as ti, k.loop(plan.tiles_w, name="tj") as tj, \
            k.loop(GROUP // lanes, name="ov") as ov:
        o = b.add(o0, b.mul(ov, k.i64(lanes)))
        t = b.add(b.mul(ti, k.i64(plan.tiles_w)), tj)
        at_t = b.add(b.mul(t, k.i64(ld)), o)
        half = []  # half[xi][s] = sum_nu prod[(xi, nu)] A[nu, s]
        for xi in range(alpha):
            vals = [b.load(b.gep(blk.prod, [b.add(k.i64((xi * alpha + nu) * plan.block_tiles * ld),
                                                  at_t)], source_etype=F32), typ=vt, align=4)
                    for nu in range(alpha)]
            half.append([_combine(b, at[s], vals) for s in range(m)])
        shift = None
        if bias is not None:  # channels past out_c read nothing
            left = b.trunc(b.sub(k.i64(plan.out_c), o), I32)
            valid = b.icmp_signed("<", iota, splat(b, left, lanes))
            shift = b.call(masked_intrinsic(k.module, "load", vt),
                           [b.gep(bias, [o], source_etype=F32), ir.Constant(I32, 4), valid,
                            ir.Constant(vt, None)])
        corner = b.add(b.mul(b.mul(ti, k.i64(m)), k.i64(yw)), b.mul(tj, k.i64(m)))
        for r in range(m):
            for s_ in range(m):
                line = _combine(b, at[r], [half[xi][s_] for xi in range(alpha)])
                if shift is not None:
                    line = b.fadd(line, shift)
                if residual is None and epilogue.activation is not None:
                    line = apply_activation(b, epilogue.activation, epilogue.params, line)
                pix = b.add(corner, k.i64(r * yw + s_))
                b.store(line, b.gep(stage, [b.add(b.mul(pix, k.i64(ld)), o)], source_etype=F32),
                        align=4)
    plane = plan.oh * plan.ow
    row0 = b.mul(blk.first, k.i64(m))
    rows = k.minimum("int64", b.mul(blk.rows, k.i64(m)), b.sub(k.i64(plan.oh), row0))
    with k.loop(GROUP // lanes, name="ov") as ov, k.loop(rows, name="oy") as oy:
        o = b.add(o0, b.mul(ov, k.i64(lanes)))
        src = b.gep(stage, [b.add(b.mul(b.mul(oy, k.i64(yw)), k.i64(ld)), o)], source_etype=F32)
        for x0 in range(0, plan.ow, lanes):
            valid = min(lanes, plan.ow - x0)
            mask = _mask(lanes, valid)
            pixels = [b.load(b.gep(src, [k.i64((x0 + j) * ld)], source_etype=F32), typ=vt,
                             align=4) if j < valid else ir.Constant(vt, ir.Undefined)
                      for j in range(lanes)]
            for i, line in enumerate(transpose_lanes(b, pixels)):  # line i: channel o + i
                off = b.add(b.mul(b.add(o, k.i64(i)), k.i64(plane)),
                            b.add(b.mul(b.add(row0, oy), k.i64(plan.ow)), k.i64(x0)))
                # the last group's channels past out_c are not stored
                with _unless(k, None if plan.out_c % GROUP == 0 else
                             b.icmp_signed(">=", b.add(o, k.i64(i)), k.i64(plan.out_c))):
                    if residual is not None:
                        skip = b.gep(residual, [off], source_etype=F32)
                        line = b.fadd(line, _load(k, vt, skip, mask))
                        if epilogue.activation is not None:
                            line = apply_activation(b, epilogue.activation, epilogue.params,
                                                    line)
                    _store(k, line, b.gep(y, [off], source_etype=F32), mask)


@contextmanager
def _unless(k: Emitter, skip: ir.Value | None) -> Iterator[None]:
    """The body, run only where `skip` is false (always when it is None)."""
    if skip is None:
        yield
    else:
        with k.if_then(k.b.not_(skip)):
            yield


# -- vector helpers ---------------------------------------------------------------------------


def _indices(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(I32, len(values)), values)


def _interleave(b: ir.IRBuilder, vs: list[ir.Value]) -> ir.Value:
    """[vs[0][0], vs[1][0], ..., vs[0][1], vs[1][1], ...]: lane l of each vector in turn."""
    lanes = vs[0].type.count
    parts = list(vs)
    while len(parts) > 1:  # concatenate pairwise (an odd one out gets undef lanes)
        if len(parts) % 2:
            parts.append(ir.Constant(parts[-1].type, ir.Undefined))
        size = parts[0].type.count
        parts = [b.shuffle_vector(parts[j], parts[j + 1], _indices(list(range(2 * size))))
                 for j in range(0, len(parts), 2)]
    # vs[s] lane l now sits at s * lanes + l (vs padded to a power of two)
    whole = parts[0]
    order = [s * lanes + lane for lane in range(lanes) for s in range(len(vs))]
    return b.shuffle_vector(whole, ir.Constant(whole.type, ir.Undefined), _indices(order))



def _mask(width: int, valid: int) -> ir.Value | None:
    """A constant mask of the first `valid` lanes (None when all are)."""
    if valid >= width:
        return None
    return ir.Constant(ir.VectorType(I1, width), [1] * valid + [0] * (width - valid))



def _store(k: Emitter, x: ir.Value, p: ir.Value, mask: ir.Value | None) -> None:
    if mask is None:
        k.b.store(x, p, align=4)
    else:
        k.b.call(masked_intrinsic(k.module, "store", x.type), [x, p, ir.Constant(I32, 4), mask])


def _load(k: Emitter, vt: ir.VectorType, p: ir.Value, mask: ir.Value | None) -> ir.Value:
    if mask is None:
        return k.b.load(p, typ=vt, align=4)
    return k.b.call(masked_intrinsic(k.module, "load", vt),
                    [p, ir.Constant(I32, 4), mask, ir.Constant(vt, None)])
