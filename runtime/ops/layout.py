"""The layout family: the network `input`, `reshape` (same elements, same order, another
shape: a view) and `transpose` (a permutation of the sample axes). Lowered from Flatten,
Reshape, Squeeze, Unsqueeze and Transpose (compiler/lowering/layout.py)."""

from __future__ import annotations

import math

from shardbound.runtime.ops.base import Op, register_op


@register_op
class Input(Op):
    """The network input; bounds are the box itself."""

    kind = "input"
    is_input = True

    @classmethod
    def summation_note(cls, facts, sums):
        return f"concretize A.center and |A|.radius over {sums(math.prod(facts.shape))}"

    def infer_shape(self):
        return self.in_shapes[0]

    def forward(self, x):
        return x

    def ibp(self, b):
        return b


@register_op
class Reshape(Op):
    """A pure layout change; the element order (row-major) is kept."""

    kind = "reshape"
    is_view = True
    backward_memory = "view"

    def setup(self, target=()):
        self.target = tuple(int(d) for d in target)

    def forward(self, x):
        return x.reshape(x.shape[0], *self.target)

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        B, S = self._rows(A)
        return [A.reshape(B, S, *self.in_shapes[0])], None


@register_op
class Transpose(Op):
    """A permutation of the sample axes (the batch axis stays first)."""

    kind = "transpose"

    def setup(self, perm=()):
        self.perm = tuple(int(p) for p in perm)

    def forward(self, x):
        return x.permute(0, *(p + 1 for p in self.perm)).contiguous()

    def ibp(self, b):
        return self.forward(b[0]), self.forward(b[1])

    def backward_linear(self, A):
        inverse = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inverse[p] = i
        return [A.permute(0, 1, *(p + 2 for p in inverse)).contiguous()], None
