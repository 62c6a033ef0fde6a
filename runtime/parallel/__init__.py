"""Running over P ranks: process groups and collectives with timeouts (`dist`), the launcher
(`launch`), fsdp parameter shards (`params`), row sharding of backward passes (`rows`), and tp
zones: the zone ops that hold a channel slice (`tp`) and their fixed-order reductions
(`tp_reduce`).

May import: `runtime.ops`, `runtime.numerics`, `runtime.accounting`, `runtime.errors`.
Never the engine, verification or program packages.
"""
