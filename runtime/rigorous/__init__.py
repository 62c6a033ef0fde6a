"""Bounds that are enclosures in exact arithmetic (`--soundness real`) or of the network as
any float32 program evaluates it (`--soundness float32`): the certificates behind `unsat`
in those modes (issue 17).

The engine (runtime/engine/network.py) bounds in float32 with round-to-nearest: fast and
tight, but its bounds can sit an ulp or so inside the true range (a minimum attained on a
vertex comes out a rounding above it), so a threshold equal to a value the network attains
can be "proved". Here every bound is checked again, in float64 with an explicit error account
(core.py has the numerics), node by node through each kernel's declared rigorous step: one
module per op family with the family's name (linear, conv, arithmetic, layout, movement,
activation, pooling, reduction, bilinear, discrete, softmax, normalization; intercepts for
the functions with computed intercepts; relaxation.py the step every elementwise relaxation
shares), and the engine (engine.py). Every registered kernel has one.

- Products: each backward step's computed coefficients are taken as the chosen ones and
  their distance from the exact product (gamma_n |Lambda| |W|) times max |input| is charged;
  bias terms and the concretisation over the box are dot products with a gamma_{n+1}
  allowance, one ulp down.
- Relaxations: lines that hold in exact arithmetic (ReLU's rounded here; the other kernels'
  are sound after their own outward rounding), their application charged.
- IBP: the same sums with the same allowance, each side one ulp outward; input boxes one
  float64 ulp outward (the decimals of a VNN-LIB file are rounded when read).
- float32 mode: each node's float32 result differs from its exact value on the same float32
  inputs by at most delta (gamma32_{K+1} (|W| |x| + |b|) for an affine node; a few float32
  ulps for an elementwise function, none for ReLU, max and data movement): added to its IBP
  interval and charged in CROWN as |Lambda| . delta.

Everything is float64 on the CPU and deterministic (the same bits for the same inputs);
bounds are per box and per row, so batches and row chunks do not change them. A kernel with
no declared step is refused in one line (`check_covered`).
"""

from shardbound.runtime.rigorous import (activation, arithmetic, bilinear,  # noqa: F401
                                         conv, discrete, intercepts, layout, linear,
                                         movement, normalization, pooling, reduction,
                                         softmax)
from shardbound.runtime.rigorous.core import to_float32_outward
from shardbound.runtime.rigorous.engine import (SOUNDNESS, RigorousBounds, check_covered,
                                                covered_kinds, rigorous_box_bounds)

__all__ = ["SOUNDNESS", "RigorousBounds", "check_covered", "covered_kinds",
           "rigorous_box_bounds", "to_float32_outward"]
