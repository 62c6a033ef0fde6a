"""How every contraction is summed: the summation orders and their kernels.

`contract` is the one door the bound kernels use (matmul, dot, sums under `fast`, `blocked` or
`exact`); `summation`, `blocktree`, `blocked_gemm`, `blocked_grid` and `ozaki` implement the
orders; `streaming` computes products with an fsdp weight streamed in blocks.

May import: torch, `runtime.errors`. Nothing else of shardbound.
"""
