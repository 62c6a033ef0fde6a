"""Memory accounting: the run-time ledger of live bytes per category (`ledger`) and the
shape-level model that predicts its peak (`memory_model`, also used by the compiler).

May import: `runtime.ops` (the memory model reads the kernels' declared traits),
`runtime.errors`.
"""
