"""The bound engine: IBP and CROWN over a network of ops (`network`), and the methods that
optimise relaxation parameters on top of it: alpha-CROWN (`alpha`), beta-CROWN for split
domains (`beta`), optimised intermediate bounds (`intermediate_alpha`), all through one
projected-gradient loop (`optimise`).

May import: `runtime.ops`, `runtime.numerics`, `runtime.accounting`, `runtime.parallel.rows`,
`runtime.errors`. Never the verification or program packages.
"""
