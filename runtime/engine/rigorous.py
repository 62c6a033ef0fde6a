"""The rigorous bounds of `--soundness real|float32` (issue 17) live in runtime/rigorous/,
one step per kernel family; this name stays for the callers that import it from here."""

from shardbound.runtime.rigorous import (SOUNDNESS, RigorousBounds,  # noqa: F401
                                         check_covered, covered_kinds, rigorous_box_bounds,
                                         to_float32_outward)
