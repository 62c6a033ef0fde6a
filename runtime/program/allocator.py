"""How a run asks the C allocator to keep freed memory: `keep_freed_memory`.

Why: a bound makes and frees the same A-matrix-sized temporaries over and over (every
iteration of alpha-CROWN, every tile of rows). glibc's malloc serves blocks above its mmap
threshold (128 KiB at first, raised as blocks are freed) with fresh pages and hands freed
memory at the top of the heap back to the system, so those temporaries are page-faulted in
again and again: measured on this 2-core machine, one full alpha-CROWN bound of
bench/vs_autolirpa.py's sigmoid_mlp made 540k minor faults and spent 15% of its time in the
kernel; with freed memory kept, 63k faults and the bound took 0.81-0.90 s instead of 1.08-1.18
(CROWN on the bench cnn -21%, resnet -18%, mnist256x2 full alpha-CROWN -20%; single runs
at load 5-7). After the one-line-per-element step (ops/selected_lines.py), which makes fewer
temporaries, the sigmoid bound gained 3-12% from it (idle). The pages are
kept by the process, never lost: the peak resident memory is the same peak.

What it sets (mallopt): blocks below MMAP_BELOW come from the heap and are reused; up to
TRIM_ABOVE bytes free at the heap's top stay mapped. Larger blocks are still mapped and
unmapped one by one. Applied by the runs' process set-up (`shardbound run`, `verify`, a
compiled program, every rank: runtime/parallel/dist.py `rank_session`); a program that
imports a compiled verifier may call it itself. Not applied where the user set glibc's own
MALLOC_*_ variables (theirs win) or SHARDBOUND_MALLOC=default; a no-op where the C library
has no mallopt (not glibc).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc's malloc.h
MMAP_BELOW = 64 << 20
TRIM_ABOVE = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Tell malloc to keep freed memory for reuse (module docstring); whether it did."""
    if os.environ.get("SHARDBOUND_MALLOC", "").strip().lower() == "default":
        return False
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_BELOW) == 1 and mallopt(M_TRIM_THRESHOLD,
                                                                  TRIM_ABOVE) == 1
