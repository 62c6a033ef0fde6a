"""VNN-LIB 2.0 twins of VNN-LIB 1.0 properties, for tests.

`to_vnnlib2` rewrites a 1.0 property as the same property in 2.0: a version line, one
network with typed, shaped input and output tensors, `X_i` as the element of X at flattened
position i (row-major in `input_shape`), `Y_j` likewise, `=` as `==`. The committed twins
of the ACAS Xu properties (tests/data/vnnlib2/acasxu/) were written with

    python tests/vnnlib_twins.py ../shared/benchmarks/acasxu tests/data/vnnlib2/acasxu

(input [1,1,1,5] and output [1,5], the shapes of the ACAS Xu networks).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

_DECL = re.compile(r"\(declare-const\s+([XY])_(\d+)\s+Real\)[ \t]*\n?")
_VAR = re.compile(r"\b([XY])_(\d+)\b")


def _element(name: str, flat: int, shape: tuple[int, ...]) -> str:
    if not shape:
        return name                 # a scalar tensor (shape []) is referred to by its name
    index = []
    for d in reversed(shape):
        index.append(flat % d)
        flat //= d
    return f"{name}[{','.join(str(i) for i in reversed(index))}]"


def to_vnnlib2(text: str, input_shape=None, output_shape=None, network="net") -> str:
    decls = _DECL.findall(text)
    n_in = 1 + max(int(i) for k, i in decls if k == "X")
    n_out = 1 + max(int(i) for k, i in decls if k == "Y")
    input_shape = tuple((n_in,) if input_shape is None else input_shape)
    output_shape = tuple((n_out,) if output_shape is None else output_shape)
    assert math.prod(input_shape) == n_in and math.prod(output_shape) == n_out
    body = _DECL.sub("", text)
    body = _VAR.sub(lambda m: _element(m.group(1), int(m.group(2)),
                                       input_shape if m.group(1) == "X" else output_shape),
                    body)
    body = re.sub(r"\(=(\s)", r"(==\1", body)
    header = ("(vnnlib-version <2.0>)\n\n"
              f"(declare-network {network}\n"
              f"    (declare-input  X float32 [{','.join(map(str, input_shape))}])\n"
              f"    (declare-output Y float32 [{','.join(map(str, output_shape))}])\n)\n")
    return header + re.sub(r"\n{3,}", "\n\n", body)


if __name__ == "__main__":
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    for path in sorted(src.glob("prop_*.vnnlib")):
        twin = to_vnnlib2(path.read_text(), (1, 1, 1, 5), (1, 5), network="acasxu")
        (dst / path.name).write_text(twin)
        print(dst / path.name)
