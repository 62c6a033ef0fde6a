"""Our VNN-LIB 2.0 reader against the PyPI `vnnlib` package (issue #20: prefer the package
if it parses the competition's files correctly and fast).

    pip install --target /tmp/vnnlibpkg vnnlib      # not a dependency of shardbound
    PYTHONPATH=/tmp/vnnlibpkg:tests python bench/vnnlib2_pkg.py [BENCHMARKS_DIR]

For the ten ACAS Xu 2.0 twins (tests/data/vnnlib2/acasxu) and the first mnistfc properties
(converted to 2.0 with tests/vnnlib_twins.py, when BENCHMARKS_DIR, default
../shared/benchmarks, has them) it prints whether the package's `vnnlib.compat.transform`
gives the same (box, output rows) pairs as `parse_vnnlib`, and the median parse time of each.
Measured with vnnlib 1.0.2: the package is 5-20x faster, but on ACAS Xu prop_6 (an `or` of
two input boxes asserted next to an `or` of output rows) it returns an unbounded box holding
the output rows and the two real boxes with no output constraint -- a property every output
violates -- so shardbound keeps its own reader.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import vnnlib  # noqa: E402
import vnnlib.compat  # noqa: E402
from vnnlib_twins import to_vnnlib2  # noqa: E402

from shardbound.compiler.vnnlib import parse_vnnlib_text  # noqa: E402


def package_pairs(text):
    out = []
    for case in vnnlib.compat.transform(vnnlib.parse_query_string(text)):
        lo = tuple(b[0] for b in case.input_box)
        hi = tuple(b[1] for b in case.input_box)
        for poly in case.output_constraints:
            out.append((lo, hi, tuple(map(tuple, np.asarray(poly.coeff_matrix, float))),
                        tuple(np.asarray(poly.rhs, float))))
    return sorted(out)


def our_pairs(text, name):
    prop = parse_vnnlib_text(text, name)
    return sorted((tuple(c.lower), tuple(c.upper), tuple(map(tuple, d.C)), tuple(d.d))
                  for c in prop.cases for d in c.disjuncts)


def median_ms(fn, repeat=5):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    bench = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared" / "benchmarks"
    files = [(p.name, p.read_text()) for p in
             sorted((ROOT / "tests" / "data" / "vnnlib2" / "acasxu").glob("prop_*.vnnlib"))]
    for p in sorted((bench / "mnistfc").glob("prop_*.vnnlib"))[:3]:
        files.append((f"mnistfc/{p.name}", to_vnnlib2(p.read_text(), (1, 1, 28, 28), (1, 10))))
    our_pairs(files[0][1], "warm-up")
    print(f"{'file':28s} {'same':>5s} {'package ms':>11s} {'ours ms':>8s}")
    for name, text in files:
        try:
            same = package_pairs(text) == our_pairs(text, name)
            pkg = f"{median_ms(lambda: package_pairs(text)):11.2f}"
        except Exception as exc:        # the package's own parse error
            same, pkg = f"error: {exc}"[:40], "-"
        print(f"{name:28s} {str(same):>5s} {pkg} {median_ms(lambda: our_pairs(text, name)):8.2f}")


if __name__ == "__main__":
    main()
