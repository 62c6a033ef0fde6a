"""runtime/program/allocator.py: runs keep freed memory for reuse. Checked by what it is for
(page faults when the same temporaries are made again), in fresh processes, and by what
leaves glibc's default alone (the user's own MALLOC_*_ variables, SHARDBOUND_MALLOC=default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Make 40 blocks of 1 MiB, free them, make them again: the page faults of the second round.
PROBE = r"""
import json, resource, sys
import numpy as np
from shardbound.runtime.program.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
blocks = [np.ones(1 << 17) for _ in range(40)]
del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [np.ones(1 << 17) for _ in range(40)]
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "SHARDBOUND_MALLOC"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         env={**clean, **env}, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    return True


@pytest.mark.skipif(not _glibc(), reason="a C library without mallopt (not glibc)")
def test_kept_memory_is_reused_without_page_faults():
    default, kept = _probe("default"), _probe("keep")
    assert kept["kept"] is True
    # 40 MiB made again: with glibc's default they are fresh pages (~10k faults)
    assert default["faults"] > 2000, default
    assert kept["faults"] * 4 < default["faults"], (kept, default)


@pytest.mark.parametrize("env", [{"SHARDBOUND_MALLOC": "default"},
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"MALLOC_MMAP_THRESHOLD_": "131072"}])
def test_the_users_choice_leaves_glibc_alone(env, monkeypatch):
    from shardbound.runtime.program.allocator import keep_freed_memory

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False     # (returns before any mallopt call)
