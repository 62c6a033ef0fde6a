"""From bounds to verdicts: properties as spec matrices (`spec`), attacks (`attack`), branch
and bound by input splitting (`input_split`) and by splitting relaxed neurons with beta-CROWN
(`relu_split`), and the stages that turn them into sat / unsat / unknown / timeout
(`verdict`).

May import: `runtime.engine`, `runtime.ops`, `runtime.errors`. Never the program package.
"""
