"""The program's entry points: loading a compiled directory (`loader`), input boxes (`boxes`),
`program.py` / `shardbound run` (`main`), one rank of a verification run (`verify_main`), and
result files (`report`).

May import every other runtime package; nothing imports this one except `runtime/__init__`.
"""
