"""The discrete family: piecewise-constant functions of computed tensors (rounding, casts to
integer and bool types, comparisons, logic, ArgMax / ArgMin, OneHot, Where with a computed
condition).

Such a function f has no useful slope, but it has sound constant lines: if [lo, hi] holds f
over the input box, the lines of slope 0 and intercepts lo (lower) and hi (upper) bound it at
every point of the box (as the activation family's `Sign` does). Each kernel therefore gives
one thing, its *interval rule* `interval(*bounds) -> (lo, hi)`: the range of its output
over the boxes of its inputs, exact where the rule can be, sound always (each rule's
docstring says why). IBP is that rule; the CROWN step hands its inputs zero A-matrices and
concretises the constants by the sign of A (a positive coefficient takes lo on the lower
side, hi on the upper), with 0 * inf = 0 (`ElementwiseRelaxation._dot_infinite`, since a
rule may give an infinite end: Floor of an infinite bound). No rule does arithmetic on two
bounds, so no NaN can appear. CROWN asks for the bounds of an input only where the output
is not already fixed (`inexact_inputs`). Nothing is optimisable or splittable.

Values: every tensor shardbound carries is float32; integer and bool tensors are carried as
their values (bool as 0 / 1), exact while |value| <= 2**24 (every float32 of larger
magnitude is an integer too, so a float -> int Cast stays exact; integer arithmetic beyond
2**24 would round, which is outside this family). The forward passes compute the same values
as onnxruntime (tests/ops/test_discrete.py compares them bit for bit).

Gradients through these functions are zero (an attack cannot follow them; a candidate is
still confirmed by the forward pass): forward attaches its inputs to the result with a zero
gradient (`_zero_grad`), so the output of a network that ends in an ArgMax still has a grad
function.

Operands: a kernel of several operands (a comparison, a logic op, Where) lists per operand
whether it is a computed input (in `inputs` order) or a constant parameter `const<k>`
(`operands`, e.g. ("computed", "const")); every operand has the output's shape (the lowering
broadcasts computed ones with `expand` moves and constants in numpy).
"""

from __future__ import annotations

import math

import torch

from shardbound.runtime.ops.base import register_op
from shardbound.runtime.ops.relaxation import ElementwiseRelaxation


class _ZeroGrad(torch.autograd.Function):
    """value, with a zero gradient for each input (the function is piecewise constant)."""

    @staticmethod
    def forward(ctx, value, *inputs):
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in inputs]
        return value

    @staticmethod
    def backward(ctx, grad):
        return (None, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def _zero_grad(value: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`value` (computed without gradient) attached to `inputs` with a zero gradient."""
    value = value.detach()
    tracked = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if tracked and torch.is_grad_enabled():
        return _ZeroGrad.apply(value, *tracked)
    return value


def _bool(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype if like.is_floating_point() else torch.float32)


def _truth(lo, hi):
    """(must be true, can be true) of values in [lo, hi] read as bools (x != 0)."""
    return (lo > 0) | (hi < 0), ~((lo == 0) & (hi == 0))


def _sum_note(facts, sums):
    return f"bias A.constant over {sums(math.prod(facts.shape))}"


class Discrete(ElementwiseRelaxation):
    """Base of the family: forward through `evaluate`, IBP and CROWN through `interval`."""

    relaxed = True
    backward_memory = "separate"
    accepts_patches = False
    infinite_lines = True           # an interval end may be infinite (floor(-inf))
    alpha_saved = (1.0, 1.0)        # the zero A-matrices of the step
    operands: tuple[str, ...] = ("computed",)

    @classmethod
    def summation_note(cls, facts, sums):
        return _sum_note(facts, sums)

    def setup(self, operands=None, **attrs):
        if operands is not None:
            self.operands = tuple(operands)
        self.configure(**attrs)

    def configure(self, **attrs):
        if attrs:
            raise TypeError(f"{self.kind} takes no attributes, got {sorted(attrs)}")

    # -- operands: computed inputs and constants, in the op's order -----------------------------
    def _gather(self, given, as_bounds: bool):
        out, k = [], 0
        for i, what in enumerate(self.operands):
            if what == "computed":
                out.append(given[k])
                k += 1
            else:
                c = self.param(f"const{i}")
                out.append((c, c) if as_bounds else c)
        return out

    # -- what subclasses give ---------------------------------------------------------------------
    def evaluate(self, *values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def interval(self, *bounds):
        """(lo, hi) of the output over the operands' boxes (each (lo, hi), (B, *shape))."""
        raise NotImplementedError

    def spread(self, unfixed: torch.Tensor, i: int) -> torch.Tensor:
        """The elements of computed input i that an unfixed output element depends on
        (elementwise ops: the same elements)."""
        return unfixed

    # -- the three semantics ----------------------------------------------------------------------
    def forward(self, *xs):
        with torch.no_grad():
            value = self.evaluate(*self._gather(xs, False))
        return _zero_grad(value, *xs)

    def ibp(self, *bounds):
        lo, hi = self.interval(*self._gather(bounds, True))
        return lo, hi

    def relax(self, lo, hi, alpha=None):       # not used: the step is crown_backward's
        raise NotImplementedError

    def crown_backward(self, lA, uA, in_bounds, alpha=None):
        lo, hi = self.ibp(*in_bounds)
        lo, hi = lo.unsqueeze(1), hi.unsqueeze(1)          # over the S rows
        none = [None] * len(self.inputs)        # zero A-matrices: the engine stops here
        l_bias = self._constant_side(lA, lo, hi)
        if uA is None:
            return none, none, l_bias, None
        return none, none, l_bias, self._constant_side(uA, hi, lo)

    def _constant_side(self, A, pos_value, neg_value):
        """sum over the node's elements of max(A, 0) * pos_value + min(A, 0) * neg_value,
        in the program's order, 0 * inf = 0."""
        B, S = self._rows(A)
        pos = A.clamp(min=0)
        return (self._bias_dot(pos, pos_value, B, S)
                + self._bias_dot(A - pos, neg_value, B, S))

    def inexact_inputs(self, in_bounds):
        """Per computed input: the elements whose bounds can matter, those that reach an
        output element not fixed under the bounds given (an input without bounds is taken
        as unbounded) and are not a point themselves."""
        ref = next((b[0] for b in in_bounds if b is not None), None)
        if ref is None:
            return [None] * len(in_bounds)
        like = dict(dtype=ref.dtype, device=ref.device)
        full = [b if b is not None else (torch.full((ref.shape[0], *s), -math.inf, **like),
                                         torch.full((ref.shape[0], *s), math.inf, **like))
                for b, s in zip(in_bounds, self.in_shapes)]
        lo, hi = self.ibp(*full)
        unfixed = lo < hi
        return [None if b is None else self.spread(unfixed, i) & (b[0] < b[1])
                for i, b in enumerate(in_bounds)]


# -- elementwise, one operand ---------------------------------------------------------------------
class Nondecreasing(Discrete):
    """f nondecreasing: f(lo) <= f(x) <= f(hi) on [lo, hi], exact (both ends are attained)."""


    def evaluate(self, x):
        return self.f(x)

    def interval(self, b):
        return self.f(b[0]), self.f(b[1])

    def f(self, x):
        raise NotImplementedError


@register_op
class Floor(Nondecreasing):
    kind = "floor"

    def f(self, x):
        return torch.floor(x)


@register_op
class Ceil(Nondecreasing):
    kind = "ceil"

    def f(self, x):
        return torch.ceil(x)


@register_op
class Round(Nondecreasing):
    """Round half to even (ONNX's Round, torch.round)."""

    kind = "round"

    def f(self, x):
        return torch.round(x)


# The integer types a computed tensor may be cast to: (bits, signed).
INT_TYPES = {"int8": (8, True), "uint8": (8, False), "int16": (16, True),
             "uint16": (16, False), "int32": (32, True), "int64": (64, True)}


@register_op
class CastInt(Discrete):
    """Cast to an integer type, as onnxruntime does on x86-64 (C conversion): truncation
    toward zero; from a float, a value outside int32 (int64 for int64) -- inf and NaN
    included -- becomes that type's minimum (the CPU's "integer indefinite"), and the 8- and
    16-bit types then keep the low bits of the int32 (wrap around); from an integer
    (`source` "int") a value outside the target's range wraps.

    Interval: trunc is nondecreasing, so [trunc(lo), trunc(hi)] where the whole interval
    converts in range; where it may leave the conversion range, the minimum joins it (float
    source, 32 / 64 bits); where a wrap may happen, the target's whole range."""

    kind = "cast_int"

    def configure(self, to="int64", source="float"):
        if to not in INT_TYPES or source not in ("float", "int"):
            raise ValueError(f"cast_int to {to!r} from {source!r}")
        self.to, self.source = to, source
        bits, signed = INT_TYPES[to]
        self.low = -(2.0 ** (bits - 1)) if signed else 0.0
        self.high = 2.0 ** (bits - 1) - 1 if signed else 2.0 ** bits - 1
        self.bits = bits
        self.conv = 64 if bits == 64 else 32        # the C conversion's width

    def _in_conversion(self, x):
        half = 2.0 ** (self.conv - 1)
        return (x >= -half) & (x < half)

    def _wrap(self, t):
        span = 2.0 ** self.bits
        return torch.remainder(t - self.low, span) + self.low

    def evaluate(self, x):
        t = torch.trunc(x.double())
        if self.source == "float":
            indefinite = torch.full_like(t, -(2.0 ** (self.conv - 1)))
            t = torch.where(self._in_conversion(x), t, indefinite)
        inside = (t >= self.low) & (t <= self.high)
        return torch.where(inside, t, self._wrap(t)).to(x.dtype)

    def interval(self, b):
        lo, hi = b
        tl, th = torch.trunc(lo), torch.trunc(hi)
        if self.source == "float":
            half = 2.0 ** (self.conv - 1)
            out = ~(self._in_conversion(lo) & self._in_conversion(hi))
            indef = torch.full_like(tl, -half)
            tl = torch.where(out, indef, tl)
            # the largest in-range truncation below hi (hi itself if in range)
            top = torch.trunc(hi.clamp(max=torch.nextafter(torch.tensor(half, dtype=hi.dtype),
                                                           torch.tensor(0.0, dtype=hi.dtype))))
            th = torch.where(out & (lo >= half), indef, torch.where(out, top, th))
            th = torch.where(out & (hi < -half), indef, th)
        inside = (tl >= self.low) & (th <= self.high)
        low = torch.full_like(tl, self.low)
        high = torch.full_like(th, self.high)
        return torch.where(inside, tl, low), torch.where(inside, th, high)


@register_op
class CastBool(Discrete):
    """Cast to bool: x != 0 (NaN is true). Not monotone: 1 where the interval excludes 0, 0
    where it is the point 0, else {0, 1}."""

    kind = "cast_bool"

    def evaluate(self, x):
        return _bool(x != 0, x)

    def interval(self, b):
        must, can = _truth(*b)
        return _bool(must, b[0]), _bool(can, b[0])


# -- elementwise, several operands ----------------------------------------------------------------
class _Relation(Discrete):
    """a R b -> {0, 1}: 1 where every pair of the boxes satisfies R, 0 where none does."""

    operands = ("computed", "computed")

    def test(self, a, b):
        raise NotImplementedError

    def always(self, a, b):
        raise NotImplementedError

    def never(self, a, b):
        raise NotImplementedError

    def evaluate(self, a, b):
        return _bool(self.test(a, b), a)

    def interval(self, a, b):
        return _bool(self.always(a, b), a[0]), _bool(~self.never(a, b), a[0])


@register_op
class Equal(_Relation):
    """Always equal only when both boxes are the same point; never when they are disjoint."""

    kind = "equal"

    def test(self, a, b):
        return a == b

    def always(self, a, b):
        return (a[0] == a[1]) & (b[0] == b[1]) & (a[0] == b[0])

    def never(self, a, b):
        return (a[1] < b[0]) | (b[1] < a[0])


@register_op
class Less(_Relation):
    """a < b: always when hi_a < lo_b, never when lo_a >= hi_b. (Greater(a, b) is Less(b, a).)"""

    kind = "less"

    def test(self, a, b):
        return a < b

    def always(self, a, b):
        return a[1] < b[0]

    def never(self, a, b):
        return a[0] >= b[1]


@register_op
class LessOrEqual(_Relation):
    """a <= b: always when hi_a <= lo_b, never when lo_a > hi_b."""

    kind = "less_or_equal"

    def test(self, a, b):
        return a <= b

    def always(self, a, b):
        return a[1] <= b[0]

    def never(self, a, b):
        return a[0] > b[1]


class _Logic(Discrete):
    """Logic on values read as bools (x != 0): from (must, can) be true of each operand."""

    operands = ("computed", "computed")

    def evaluate(self, a, b):
        return _bool(self.apply(a != 0, b != 0), a)

    def interval(self, a, b):
        (ma, ca), (mb, cb) = _truth(*a), _truth(*b)
        lo, hi = self.range(ma, ca, mb, cb)
        return _bool(lo, a[0]), _bool(hi, a[0])


@register_op
class And(_Logic):
    kind = "and"

    def apply(self, a, b):
        return a & b

    def range(self, ma, ca, mb, cb):
        return ma & mb, ca & cb


@register_op
class Or(_Logic):
    kind = "or"

    def apply(self, a, b):
        return a | b

    def range(self, ma, ca, mb, cb):
        return ma | mb, ca | cb


@register_op
class Xor(_Logic):
    """Fixed only where both operands are fixed."""

    kind = "xor"

    def apply(self, a, b):
        return a ^ b

    def range(self, ma, ca, mb, cb):
        fixed = (ma | ~ca) & (mb | ~cb)
        value = ma ^ mb
        return fixed & value, ~fixed | value


@register_op
class Where(Discrete):
    """cond ? x : y (cond read as a bool): x's box where cond is surely true, y's where it is
    surely false, else the hull of both."""

    kind = "where_select"
    operands = ("computed", "computed", "computed")

    def evaluate(self, c, x, y):
        return torch.where(c != 0, x, y)

    def interval(self, c, x, y):
        must, can = _truth(*c)
        lo = torch.where(must, x[0], torch.where(can, torch.minimum(x[0], y[0]), y[0]))
        hi = torch.where(must, x[1], torch.where(can, torch.maximum(x[1], y[1]), y[1]))
        return lo, hi


# -- along an axis --------------------------------------------------------------------------------
def _exclusive_cummax(t: torch.Tensor) -> torch.Tensor:
    """max of t[..., :j] at j along the last axis (-inf at 0)."""
    inc = torch.cummax(t, dim=-1).values
    return torch.cat([torch.full_like(inc[..., :1], -math.inf), inc[..., :-1]], dim=-1)


@register_op
class ArgMax(Discrete):
    """The index of the largest element along `axis` (a per-sample axis): the first one
    among equals, the last with `select_last_index`; `keepdims` keeps the axis as size 1.

    Interval: element j can be the answer only if it can reach every element before it
    strictly (hi_j > lo_k for k before j; for the first-index rule a tie goes to the earlier
    one) and every element after it (hi_j >= lo_k), mirrored for select_last_index. At
    least the element with the largest lower bound that the rule picks is always a
    candidate, so the output lies in [first candidate, last candidate], a point when one
    candidate remains."""

    kind = "argmax"

    def configure(self, axis=0, keepdims=True, select_last_index=False):
        self.axis, self.keepdims, self.last = int(axis), bool(keepdims), bool(select_last_index)

    def _key(self, x):
        return x

    def _key_bounds(self, b):
        return b

    def evaluate(self, x):
        key = self._key(x.movedim(self.axis + 1, -1))
        if self.last:
            idx = key.shape[-1] - 1 - torch.argmax(key.flip(-1), dim=-1)
        else:
            idx = torch.argmax(key, dim=-1)
        return self._out(idx.to(x.dtype))

    def _out(self, idx):
        return idx.unsqueeze(self.axis + 1) if self.keepdims else idx

    def interval(self, b):
        lo, hi = (t.movedim(self.axis + 1, -1) for t in self._key_bounds(b))
        before = _exclusive_cummax(lo)
        after = _exclusive_cummax(lo.flip(-1)).flip(-1)
        if self.last:           # ties go to the later element
            cand = (hi >= before) & (hi > after)
        else:
            cand = (hi > before) & (hi >= after)
        n = lo.shape[-1]
        idx = torch.arange(n, dtype=lo.dtype, device=lo.device)
        first = torch.where(cand, idx, torch.full_like(lo, n)).amin(-1)
        last = torch.where(cand, idx, torch.full_like(lo, -1)).amax(-1)
        # No candidate only where bounds are infinite (hi = -inf everywhere): any index.
        none = first > last
        first = torch.where(none, torch.zeros_like(first), first)
        last = torch.where(none, torch.full_like(last, n - 1), last)
        return self._out(first), self._out(last)

    def spread(self, unfixed, i):
        shape = self.in_shapes[0]
        u = unfixed if self.keepdims else unfixed.unsqueeze(self.axis + 1)
        return u.expand(u.shape[0], *shape)


@register_op
class ArgMin(ArgMax):
    """ArgMax of -x (the same tie rules: first or last among the smallest)."""

    kind = "argmin"

    def _key(self, x):
        return -x

    def _key_bounds(self, b):
        return -b[1], -b[0]


@register_op
class OneHot(Discrete):
    """out[.., d, ..] = on where trunc(index) (negative: + depth) is d, else off; `axis` is
    the per-sample output axis of the depth. Interval: d is possible where it (or d - depth)
    lies in [trunc(lo), trunc(hi)] (trunc is nondecreasing and indices are integers), and
    off is possible unless the index is fixed to d."""

    kind = "one_hot"

    def configure(self, axis=-1, depth=2, off=0.0, on=1.0):
        self.axis, self.depth, self.off, self.on = int(axis), int(depth), float(off), float(on)

    def infer_shape(self):
        s = list(self.in_shapes[0])
        s.insert(self.axis, self.depth)
        return tuple(s)

    def _positions(self, like):
        shape = [1] * (len(self.in_shapes[0]) + 2)
        shape[self.axis + 1] = self.depth
        return torch.arange(self.depth, dtype=like.dtype, device=like.device).reshape(shape)

    def evaluate(self, x):
        k = torch.trunc(x)
        k = torch.where(k < 0, k + self.depth, k).unsqueeze(self.axis + 1)
        hit = k == self._positions(x)
        return torch.where(hit, torch.full_like(hit, self.on, dtype=x.dtype),
                           torch.full_like(hit, self.off, dtype=x.dtype))

    def interval(self, b):
        tl, th = (torch.trunc(t).unsqueeze(self.axis + 1) for t in b)
        d = self._positions(tl)
        can_on = ((tl <= d) & (d <= th)) | ((tl <= d - self.depth) & (d - self.depth <= th))
        fixed = (tl == th) & ((tl == d) | (tl == d - self.depth))
        can_off = ~fixed
        lo_v, hi_v = min(self.on, self.off), max(self.on, self.off)
        on = torch.full_like(can_on, self.on, dtype=tl.dtype)
        off = torch.full_like(can_on, self.off, dtype=tl.dtype)
        both = can_on & can_off
        lo = torch.where(both, torch.full_like(on, lo_v), torch.where(can_on, on, off))
        hi = torch.where(both, torch.full_like(on, hi_v), torch.where(can_on, on, off))
        return lo, hi

    def spread(self, unfixed, i):
        return unfixed.any(dim=self.axis + 1)
