"""Tensor-parallel (tp) mode at run time: zone ops that hold a slice of the hidden channels.

A zone (found by the compiler's tp_zones pass) is column layer -> elementwise ops -> row layer.
Each rank holds channels [c0, c1) of the zone's C hidden channels (`tp_reduce` decides the
split): the column layer's weight rows and bias entries of those channels (output Shard(0)),
the elementwise ops' constants of those channels, and the row layer's weight columns of those
channels (output Partial, finished by the fixed-order reduction, then + the replicated bias).
Nodes outside zones are replicated: every rank holds them whole.

CROWN backward passes through a zone with every rank holding all rows of the A-matrix but only
its channels' columns (1/P of the zone's A-matrices): the row layer's backward product is local
(its contraction is over the replicated output), the column layer's and the bias terms are
Partial and reduced. Intermediate bounds of zone nodes come from IBP (the compiler's default,
no communication) or from CROWN (`--tp-intermediate crown`), with an identity over the node's
own channels: when no zone lies upstream, each rank bounds only its own neurons ("local rows":
no communication, A-matrices of 1/P rows); otherwise every rank carries all rows and its
columns through the reductions above. With `blocked` the bounds are bitwise those of single mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from safetensors import safe_open

from shardbound.runtime.numerics import contract
from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.ops import OP_TYPES, Conv2d, Linear
from shardbound.runtime.parallel.rows import unit_rows
from shardbound.runtime.parallel.tp_reduce import REDUCTIONS, local_of_replicated, spatial


class TpContext:
    """What a rank's zone ops share: the communicator, the ledger, one Reduction per zone, and
    whether the current backward pass carries local rows (see module docstring)."""

    def __init__(self, comm, ledger, order: str):
        if order not in REDUCTIONS:
            raise ShardboundError(f"tp mode does not support --summation {order}; recompile "
                                  f"with one of {', '.join(sorted(REDUCTIONS))}")
        self.comm, self.ledger, self.order = comm, ledger, order
        self.zones: dict[int, object] = {}
        self.rows_local = False

    def zone(self, index: int, channels: int):
        red = self.zones.get(index)
        if red is None:
            red = self.zones[index] = REDUCTIONS[self.order](channels, self.comm, self.ledger,
                                                            self.order)
        return red


class ZoneOp:
    """Mixin for ops inside a zone. Attributes from the program: `tp_zone` (zone index),
    `tp_channels` (C), `tp_local_rows` (CROWN targets here may use local rows)."""

    tp_role = "?"

    def setup(self, tp_zone=0, tp_channels=1, tp_local_rows=False, **attrs):
        self.tp_zone, self.tp_channels = int(tp_zone), int(tp_channels)
        self.tp_local_rows = bool(tp_local_rows)
        super().setup(**attrs)

    # -- binding to a rank -----------------------------------------------------------------
    def bind(self, ctx: TpContext, ledger) -> None:
        self.ctx = ctx
        self.red = ctx.zone(self.tp_zone, self.tp_channels)
        self.full_shape = self.shape
        self._localize()
        # What the memory model (runtime/accounting/tp_model.py) needs of the whole node:
        # each parameter's elements and whether this rank holds a channel slice of it.
        self.tp_param_numels, self.tp_sliced = {}, {}
        for role in list(self.params):
            src = self.params[role]
            if isinstance(src, ParamSource):
                index = self._slice(role, src.shape)
                self.tp_param_numels[role] = math.prod(src.shape)
                self.tp_sliced[role] = any(s != slice(None) for s in index)
                self.params[role] = src.read(index)
                ledger.add("resident_param", self.params[role].numel() * 4)

    def _localize(self) -> None:
        """Shapes of this rank's slice (the column/elementwise output is channel-sliced)."""
        self.shape = (self.red.local, *self.full_shape[1:])

    def _slice(self, role: str, shape) -> tuple:
        """The index of this rank's part of a parameter (default: channel dim 0)."""
        return (slice(self.red.c0, self.red.c1),)


class ShardOutput(ZoneOp):
    """A zone op whose output is Shard(0): the column layer and the elementwise ops."""

    def crown_bounds(self, network, lower, upper, known, index=None):
        """CROWN bounds of this rank's neurons (the engine's hook for planned crown nodes)."""
        return crown_zone_node(network, self, lower, upper, known, index)

    def _dot(self, a, b):
        if self.ctx.rows_local:
            return contract.dot_last(a, b, self.order)
        return self.red.dot(a, b, spatial(self.full_shape))

    # -- this rank's neurons within the whole node (ReLU branch and bound) -----------------
    def neuron_range(self) -> tuple[int, int, int]:
        """(start, stop, total): this rank's neurons as flat indices of the whole node."""
        X = spatial(self.full_shape)
        return self.red.c0 * X, self.red.c1 * X, math.prod(self.full_shape)

    def gather_neurons(self, t: torch.Tensor) -> torch.Tensor:
        """(b, this rank's neurons) -> (b, all neurons), in channel order, on every rank."""
        X = spatial(self.full_shape)
        widths = [(c1 - c0) * X for c0, c1 in self.red.ranges]
        b, width = t.shape[0], max(widths)
        padded = t.new_zeros((b, width))
        padded[:, :t.shape[1]] = t
        every = self.ctx.comm.all_gather_flat(padded.reshape(-1)).reshape(len(widths), b, width)
        return torch.cat([every[r, :, :w] for r, w in enumerate(widths)], dim=1)


class ColumnLinear(ShardOutput, Linear):
    """Weight rows (output neurons) of this rank's channels: output Shard(0)."""

    tp_role = "column"

    def forward(self, x):
        """Differentiable w.r.t. the replicated x (attacks): see Reduction.column_matmul."""
        return self._with_bias(self.red.column_matmul(x, self.param("weight")))

    def backward_linear(self, A):
        w_t = self.param("weight").t().contiguous()
        if self.ctx.rows_local:     # rows are my own neurons: the product is complete
            A_in = contract.matmul(A, w_t, self.order)
        else:
            A_in = self.red.matmul(A, w_t)
        b = self.param("bias")
        return [A_in], (None if b is None else self._dot(A, b))


class RowLinear(ZoneOp, Linear):
    """Weight columns (inputs) of this rank's channels: output Partial, reduced, + bias."""

    tp_role = "row"

    def _localize(self):
        self.in_shapes = ((self.red.local,),)

    def forward(self, x):
        return self._affine(x, self.param("weight"))

    def _slice(self, role, shape):
        if role == "weight":
            return (slice(None), slice(self.red.c0, self.red.c1))
        return (slice(None),)

    def backward_linear(self, A):
        """A (replicated) -> the A of this rank's input channels; the bias is replicated.
        The product is the column layer's forward pair (`Reduction.column_matmul`): its
        gradient w.r.t. the replicated A sums over the zone's channels in the reduction's
        order, which `blocked` finishes in single mode's tree for any P (summing every rank's
        part in rank order broke that tree once a rank held part of a subtree: 8 blocks on
        P = 4)."""
        w_t = self.param("weight").t().contiguous()
        return [self.red.column_matmul(A, w_t)], self._bias_term(A)

    def _affine(self, x, w, with_bias=True):
        y = self.red.matmul(x, w)
        b = self.param("bias")
        return y + b if (with_bias and b is not None) else y

    def ibp(self, b):
        c, r = (b[1] + b[0]) / 2, (b[1] - b[0]) / 2
        yc = self._affine(c, self.param("weight"))
        yr = self.red.matmul(r, self.param("weight").abs())
        return yc - yr, yc + yr


class ShardElementwise(ShardOutput):
    """An op that acts on each channel alone (its kernel declares the tp role "elementwise"),
    holding this rank's channels: inputs and output Shard(0). Constants broadcast to the sample
    shape are sliced on their channel dim when they have one (same rank as the sample shape
    and more than one channel), else kept whole. `zone_op` makes one such class per kernel."""

    tp_role = "elementwise"

    def _localize(self):
        super()._localize()
        self.full_in_shapes = self.in_shapes
        self.in_shapes = tuple((self.red.local, *s[1:]) for s in self.in_shapes)

    def _slice(self, role, shape):
        if len(shape) == len(self.full_shape) and shape and shape[0] == self.tp_channels > 1:
            return (slice(self.red.c0, self.red.c1),)
        return ()


class ColumnConv(ShardOutput, Conv2d):
    """Output channels of this rank: output Shard(0). The backward product (over output
    channels) runs as im2col matmul (Conv2d's hooks), reduced across ranks before the patches
    are folded."""

    tp_role = "column"

    def forward(self, x):
        """Differentiable w.r.t. the replicated x, as ColumnLinear.forward."""
        return local_of_replicated(self.red, x, lambda a: Conv2d.forward(self, a))

    def _conv(self, x, w, with_bias=True):
        if w.shape[0] == 0:             # no channels on this rank
            return x.new_zeros((x.shape[0], *self.shape))
        return super()._conv(x, w, with_bias)

    _transposed_conv_ok = False     # the contraction over output channels is reduced

    def _cout_product(self, A_cols, w_t):
        if self.ctx.rows_local:
            return contract.matmul(A_cols, w_t, self.order)
        return self.red.matmul(A_cols, w_t)

    def _channel_dot(self, per_channel, b):
        if self.ctx.rows_local:
            return contract.dot_last(per_channel, b, self.order)
        return self.red.dot(per_channel, b, 1)


class RowConv(ZoneOp, Conv2d):
    """Input channels of this rank: the im2col product over (channels x kernel) is Partial,
    reduced, + the replicated bias."""

    tp_role = "row"

    def _localize(self):
        self.in_shapes = ((self.red.local, *self.in_shapes[0][1:]),)

    def _slice(self, role, shape):
        if role == "weight":
            return (slice(None), slice(self.red.c0, self.red.c1))
        return (slice(None),)

    def _conv(self, x, w, with_bias=True):
        pt, pl, pb, pr = self.pads
        x = F.pad(x, (pl, pr, pt, pb))
        Cout, kh, kw = w.shape[0], *w.shape[2:]
        Ho, Wo = self._out_hw(x, w)
        if x.shape[1] == 0:             # no channels on this rank: it still joins the reduction
            # (an empty view of x, so that gradients reach x's producers and their collectives)
            cols = x.reshape(x.shape[0], 1, 0).expand(-1, Ho * Wo, 0)
        else:
            cols = F.unfold(x, (kh, kw), dilation=self.dilations, stride=self.strides)
            cols = cols.transpose(1, 2).contiguous()                   # (B, L, c*kh*kw)
        y = self.red.matmul(cols, w.reshape(Cout, -1).contiguous(), kh * kw)
        y = y.transpose(1, 2).reshape(x.shape[0], Cout, Ho, Wo)
        b = self.param("bias") if with_bias else None
        return y + b.reshape(1, b.numel(), 1, 1) if b is not None else y.contiguous()

    def backward_linear(self, A):
        """A (replicated) -> the A of this rank's input channels; the bias is replicated.
        Under the ordered summations alpha-CROWN differentiates through Conv2d's own step
        (`conv._OrderedTransposedConv`), whose gradient w.r.t. the replicated A contracts
        over input channels x taps: here that product is Partial (`_cin_product`), reduced in
        `blocked`'s pair tree, so the gradient has single mode's bits for any P (summing
        every rank's part in rank order broke the tree from 4 owning ranks on). `fast` sums
        the ranks' parts in rank order (`local_of_replicated`)."""
        if self.order != "fast" or (self.red.local and not A.requires_grad):
            return super().backward_linear(A)
        B, S = self._rows(A)

        def my_channels(a):                 # the A of this rank's input channels
            if not self.red.local:
                return a.new_zeros((B, S, *self.in_shapes[0]))
            return Conv2d.backward_linear(self, a)[0][0]

        # a rank without channels still joins the gradient's reduction
        A_in = local_of_replicated(self.red, A, my_channels)
        b = self.param("bias")
        if b is None:
            return [A_in], None
        Cout, Ho, Wo = self.shape
        per_channel = contract.sum_last(A.reshape(B, S, Cout, Ho * Wo), self.order)
        return [A_in], contract.dot_last(per_channel, b, self.order)

    def _backward_im2col(self, A_flat, w, out_hw, offset=(0, 0)):
        if not self.red.local:              # no channels on this rank
            return A_flat.new_zeros((A_flat.shape[0], 0, *out_hw))
        return super()._backward_im2col(A_flat, w, out_hw, offset)

    def _contracted_channels(self, C_in):
        return self.tp_channels

    def _cin_product(self, cols, w_rows, taps):
        return self.red.reduce_matmul(cols, w_rows, taps)


# Layers split on their output (column) or input (row) channels have kernels of their own:
# their contractions become Partial. Elementwise zone ops are made from any kernel that
# declares the role (see zone_op).
LAYER_ZONE_OPS = {(Linear, "column"): ColumnLinear, (Linear, "row"): RowLinear,
                  (Conv2d, "column"): ColumnConv, (Conv2d, "row"): RowConv}
_ELEMENTWISE: dict[type, type] = {}


def zone_op(kind: str, role: str) -> type:
    """The zone kernel of IR op `kind` in tp role `role` ("column", "row", "elementwise")."""
    cls = OP_TYPES[kind]
    if role != "elementwise":
        return LAYER_ZONE_OPS[(cls, role)]
    if "elementwise" not in cls.tp_roles:
        raise KeyError(f"{cls.__name__} does not declare the tp role 'elementwise'")
    made = _ELEMENTWISE.get(cls)
    if made is None:
        made = _ELEMENTWISE[cls] = type(f"Shard{cls.__name__}", (ShardElementwise, cls),
                                        {"__module__": __name__, "__doc__": cls.__doc__})
    return made


def __getattr__(name: str):
    """`tp.Shard<Kernel>` in a generated program: the elementwise zone op of that kernel."""
    if name.startswith("Shard"):
        for kind, cls in OP_TYPES.items():
            if cls.__name__ == name[len("Shard"):] and "elementwise" in cls.tp_roles:
                return zone_op(kind, "elementwise")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- parameters and binding ---------------------------------------------------------------------
class ParamSource:
    """A tensor of weights.safetensors not read yet: `read(index)` reads only that slice."""

    def __init__(self, handle, key: str):
        self.handle, self.key = handle, key
        self.shape = tuple(handle.get_slice(key).get_shape())

    def read(self, index: tuple) -> torch.Tensor:
        if not self.shape:
            return self.handle.get_tensor(self.key).to(torch.float32)
        full = torch.empty(self.shape, device="meta")
        want = tuple(full[index].shape) if index else self.shape
        if 0 in want:                   # an empty slice (a rank past the last block)
            return torch.zeros(want, dtype=torch.float32)
        sl = self.handle.get_slice(self.key)
        return sl[index if index else slice(None)].to(torch.float32).contiguous()


def build_network(module, path: str, comm, ledger, order: str):
    """Build a tp program's network on this rank: zone ops read their slices, the others the
    whole tensors."""
    ctx = TpContext(comm, ledger, order)
    try:
        handle_cm = safe_open(path, framework="pt")
    except FileNotFoundError:
        raise ShardboundError(f"{path}: missing; recompile the model") from None
    except Exception as e:
        raise ShardboundError(f"{path}: unreadable weights ({type(e).__name__}); recompile") from None
    with handle_cm as f:
        params = {k: ParamSource(f, k) for k in f.keys()}
        network = module.build(params, order=order)
        for n in network.nodes:
            if isinstance(n, ZoneOp):
                n.bind(ctx, ledger)
                continue
            for role, src in list(n.params.items()):
                if isinstance(src, ParamSource):
                    n.params[role] = src.read(())
                    ledger.add("resident_param", n.params[role].numel() * 4)
    for n in network.nodes:
        for role, t in n.params.items():
            if isinstance(t, torch.Tensor):
                n.params[role] = t.to(comm.device)
    network.tp = ctx
    network.refine_ibp = True
    return network


# -- CROWN bounds of a zone node ------------------------------------------------------------------
def crown_zone_node(network, node: ShardOutput, lower, upper, known, index=None):
    """CROWN bounds (B, *local shape) of this rank's neurons of a zone node; with `index`
    (flat indices among this rank's neurons, ascending), of those only: (B, len(index))."""
    B = lower.shape[0]
    n = math.prod(node.shape)
    mine = torch.arange(n) if index is None else torch.as_tensor(index).reshape(-1)
    if node.tp_local_rows:
        node.pass_rows = len(mine)          # rows of this rank's largest pass (memory model)
        lo, hi = _local_rows(network, node, mine, lower, upper, known)
    else:
        lo, hi = _all_rows(network, node, mine, index is None, lower, upper, known)
    if index is None:
        return lo.reshape(B, *node.shape), hi.reshape(B, *node.shape)
    return lo, hi


def _local_rows(network, node, mine, lower, upper, known):
    """Each rank bounds its own neurons: no communication, A-matrices of len(mine) rows."""
    B, n = lower.shape[0], math.prod(node.shape)
    if len(mine) == 0:                  # nothing to bound here, and no collectives to join
        empty = torch.zeros((B, 0), dtype=lower.dtype, device=lower.device)
        return empty, empty.clone()
    eye = unit_rows(mine, n, lower.dtype, lower.device).reshape(len(mine), *node.shape)
    node.ctx.rows_local = True
    try:
        return network.backward(node, eye.unsqueeze(0).expand(B, *eye.shape), lower, upper,
                                known)
    finally:
        node.ctx.rows_local = False


def _all_rows(network, node, mine, every_neuron, lower, upper, known):
    """Every rank carries the rows of every rank's wanted neurons (all of the node's when
    `every_neuron`, else their union, gathered, so the collectives match) with only its own
    columns, in P row tiles: the replicated parts of the A-matrices (at nodes outside the
    zone) and the reduction buffers then fall with P too. Row tiles do not change bits: every
    kernel's rows are independent."""
    B, n = lower.shape[0], math.prod(node.shape)
    offset = node.red.c0 * spatial(node.full_shape)
    if every_neuron:
        rows = torch.arange(math.prod(node.full_shape))
    else:
        wanted = torch.zeros((1, n), dtype=lower.dtype)
        wanted[0, mine] = 1
        rows = torch.nonzero(node.gather_neurons(wanted)[0] > 0).reshape(-1)   # ascending
    tile = max(1, -(-len(rows) // node.ctx.comm.world))
    node.pass_rows = min(tile, len(rows))
    los, his = [], []
    for s0 in range(0, len(rows), tile):
        chunk = rows[s0:s0 + tile]
        here = (chunk >= offset) & (chunk < offset + n)           # rows of my own neurons
        eye = torch.zeros(len(chunk), n, dtype=lower.dtype)
        eye[torch.nonzero(here).reshape(-1), chunk[here] - offset] = 1
        eye = eye.to(lower.device).reshape(len(chunk), *node.shape)
        lo, hi = network.backward(node, eye.unsqueeze(0).expand(B, *eye.shape), lower, upper,
                                  known)
        keep = torch.nonzero(here).reshape(-1).to(lower.device)
        los.append(lo.index_select(1, keep))
        his.append(hi.index_select(1, keep))
    if not los:
        empty = torch.zeros((B, 0), dtype=lower.dtype, device=lower.device)
        return empty, empty.clone()
    return torch.cat(los, dim=1), torch.cat(his, dim=1)


# -- full alpha-CROWN's start rows of a zone node ---------------------------------------------------
class ZoneStartRows:
    """The rows full alpha-CROWN (runtime/engine/full_alpha.py) optimises for a zone node,
    rows z_i then -z_i of its neurons inexact in some box, laid out as tp's CROWN bounds the
    node (`crown_zone_node`):

    - `local` (no zone upstream, `tp_local_rows`): each rank carries the rows of its own
      neurons alone, with no collective in the pass; `index` is this rank's neurons (flat,
      local numbering), so the rows' alphas and Adam's moments are this rank's and no other's;
    - otherwise every rank carries the rows of every rank's inexact neurons (`index`: flat,
      whole-node numbering, ascending), each with its own channels' columns (the reductions
      finish them), and holds the alphas of those rows at its zone channels (replicated ops'
      alphas, like their A-matrices, on every rank); the bounds of the rows come out on every
      rank, and each keeps those of its own neurons (`offset`: its first neuron).

    `total` is the number of inexact neurons over all ranks (every rank decides alike)."""

    def __init__(self, network, node: ShardOutput, known, B: int):
        lo, hi = (t.reshape(B, -1) for t in known[node.name])
        mask = network.inexact_mask(node, known[node.name]).reshape(B, -1).any(dim=0)
        every = node.gather_neurons(mask.to(lo.dtype).unsqueeze(0))[0] > 0
        self.total = int(every.sum())
        self.local = bool(node.tp_local_rows)
        self.offset, n = node.neuron_range()[0], lo.shape[1]
        if self.local:
            self.index = torch.nonzero(mask).reshape(-1).cpu()
            eye = unit_rows(self.index, n, lo.dtype, lo.device)
            idx = self.index.to(lo.device)
            self.best = torch.cat([lo[:, idx], -hi[:, idx]], dim=1)
        else:
            self.index = torch.nonzero(every).reshape(-1).cpu()
            here = (self.index >= self.offset) & (self.index < self.offset + n)
            eye = torch.zeros(len(self.index), n, dtype=lo.dtype)
            eye[torch.nonzero(here).reshape(-1), self.index[here] - self.offset] = 1
            eye = eye.to(lo.device)
            both = node.gather_neurons(torch.cat([lo, hi]))         # (2B, all neurons)
            idx = self.index.to(lo.device)
            self.best = torch.cat([both[:B, idx], -both[B:, idx]], dim=1)
        A = torch.cat([eye, -eye]).reshape(1, 2 * len(self.index), *node.shape)
        self.A = A.expand(B, *A.shape[1:])

    def merged(self, best: torch.Tensor, base):
        """This rank's bounds of the node (`base`, (B, *local shape)) with the rows' best
        bounds (B, 2 len(index)) of its own neurons."""
        lo, hi = base
        B, k, n = lo.shape[0], len(self.index), math.prod(lo.shape[1:])
        new_lo, new_hi = lo.reshape(B, n).clone(), hi.reshape(B, n).clone()
        rows = torch.arange(k)
        cols = self.index - (0 if self.local else self.offset)
        if not self.local:
            mine = (cols >= 0) & (cols < n)
            rows, cols = rows[mine], cols[mine]
        rows, cols = rows.to(lo.device), cols.to(lo.device)
        new_lo[:, cols] = torch.maximum(new_lo[:, cols], best[:, rows])
        new_hi[:, cols] = torch.minimum(new_hi[:, cols], -best[:, k + rows])
        return new_lo.reshape(lo.shape), new_hi.reshape(hi.shape)

    def backward(self, network, node, lower, upper, known, alphas, layout):
        """The lower bounds (B, rows) of the rows through the network (see the class)."""
        if not self.local:
            return network.backward(node, self.A, lower, upper, known, alphas,
                                    lower_only=True, alpha_layout=layout)[0]
        node.ctx.rows_local = True
        try:
            return network.backward(node, self.A, lower, upper, known, alphas,
                                    lower_only=True, alpha_layout=layout)[0]
        finally:
            node.ctx.rows_local = False

    @property
    def runs(self) -> bool:
        """Whether this rank runs the rows' pass (a rank without rows of its own on local
        rows has nothing to bound, and the pass has no collective to join)."""
        return len(self.index) > 0
