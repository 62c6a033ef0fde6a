"""How much memory this process may still take: the default memory budget of `verify`.

A run that passes the machine's memory is killed by the kernel (the OOM killer), with no
answer and no line saying why. `verify` without `--memory-budget` therefore plans for a
default budget taken from the memory actually available to it: the smaller of

- `MemAvailable` of /proc/meminfo (what the kernel can hand out without swapping: free
  memory plus reclaimable caches; already net of what every process, this one included,
  holds), and
- the headroom of the process's memory cgroup where one sets a limit (a container, a
  systemd slice, a batch job): cgroup v2 `memory.max - memory.current`, v1
  `memory.limit_in_bytes - memory.usage_in_bytes`, each plus the group's inactive file
  cache (reclaimable), the smallest over the group and its ancestors (a parent's limit
  binds its children),

times DEFAULT_FRACTION. The fraction covers what the ledger does not track (the allocator's
fragmentation, the interpreter and torch themselves, temporaries inside a kernel call) and
other processes growing while the run does: measured on the cgan benchmark, the RSS sat
~1.5 GB above the tracked peak. Nothing here imports torch: the compiler calls it.

Every reader takes its files as paths (tests give their own; nothing depends on the
machine the tests run on).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_FRACTION = 0.5          # of the available memory, for the tracked peak
UNLIMITED = 1 << 60             # cgroup v1 writes "no limit" as a huge number (2^63 - 4096)

MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_V2_ROOT = "/sys/fs/cgroup"
CGROUP_V1_ROOT = "/sys/fs/cgroup/memory"


@dataclass(frozen=True)
class Available:
    """Bytes this process may still take, and where the figure comes from (for the plan
    line: `MemAvailable` or `cgroup v2 /sys/fs/cgroup/x`)."""

    bytes: int
    source: str


def parse_meminfo(text: str) -> int | None:
    """MemAvailable in bytes from /proc/meminfo's text (None when the line is missing:
    kernels before 3.14)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                value = int(parts[1])
            except (IndexError, ValueError):
                return None
            unit = parts[2].lower() if len(parts) > 2 else "kb"
            return value * (1024 if unit == "kb" else 1)
    return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(text: str | None, names) -> int:
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            try:
                return int(parts[1])
            except ValueError:
                return 0
    return 0


# (limit file, usage file, reclaimable fields of memory.stat) per cgroup version
_FILES = {"v2": ("memory.max", "memory.current", ("inactive_file",)),
          "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes",
                 ("total_inactive_file", "inactive_file"))}


def _group_dirs(root: str, path: str) -> list[str]:
    """The group's directory under `root` and its ancestors up to `root` (a namespaced
    container sees its own group as `/`, or a path that does not exist under its mount:
    then the mount itself is the group)."""
    leaf = os.path.join(root, path.lstrip("/")) if path.strip("/") else root
    if not os.path.isdir(leaf):
        leaf = root
    dirs, d = [], os.path.normpath(leaf)
    root = os.path.normpath(root)
    while True:
        dirs.append(d)
        if d == root or not d.startswith(root):
            break
        d = os.path.dirname(d)
    return dirs


def cgroup_headroom(proc_cgroup: str = PROC_CGROUP, v2_root: str = CGROUP_V2_ROOT,
                    v1_root: str = CGROUP_V1_ROOT) -> Available | None:
    """The least headroom (limit - usage + inactive file cache) over this process's memory
    cgroup and its ancestors, or None where no limit applies (or nothing can be read)."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    groups = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            groups.append(("v2", v2_root, parts[2]))
        elif "memory" in parts[1].split(","):
            groups.append(("v1", v1_root, parts[2]))
    best: Available | None = None
    for version, root, path in groups:
        limit_file, usage_file, reclaimable = _FILES[version]
        for d in _group_dirs(root, path):
            limit = _number(_read(os.path.join(d, limit_file)))
            usage = _number(_read(os.path.join(d, usage_file)))
            if limit is None or usage is None or limit >= UNLIMITED:
                continue
            cache = _stat_field(_read(os.path.join(d, "memory.stat")), reclaimable)
            room = max(0, limit - max(0, usage - cache))
            if best is None or room < best.bytes:
                best = Available(room, f"cgroup {version} {d}")
    return best


def available_memory(meminfo: str = MEMINFO, proc_cgroup: str = PROC_CGROUP,
                     v2_root: str = CGROUP_V2_ROOT,
                     v1_root: str = CGROUP_V1_ROOT) -> Available | None:
    """The memory this process may still take: the smaller of MemAvailable and its cgroup's
    headroom; None when neither can be read (not Linux)."""
    text = _read(meminfo)
    free = parse_meminfo(text) if text is not None else None
    found = Available(free, "MemAvailable") if free is not None else None
    group = cgroup_headroom(proc_cgroup, v2_root, v1_root)
    if group is not None and (found is None or group.bytes < found.bytes):
        found = group
    return found


@dataclass(frozen=True)
class DefaultBudget:
    """verify's budget when the user gives none: per rank, DEFAULT_FRACTION of the
    available memory shared by the job's ranks (they run on this machine)."""

    per_rank: int
    available: Available
    fraction: float
    nproc: int

    def describe(self) -> str:
        from shardbound.runtime.accounting.ledger import format_bytes

        share = f", shared by {self.nproc} ranks" if self.nproc > 1 else ""
        return (f"default: {self.fraction:.0%} of {self.available.source} "
                f"{format_bytes(self.available.bytes)}{share}; --memory-budget none: off")


def default_budget(nproc: int = 1, reader=None,
                   fraction: float = DEFAULT_FRACTION) -> DefaultBudget | None:
    """The default budget per rank for a job of `nproc` ranks (None: the available memory
    cannot be read, then nothing is planned for it). `reader` (default: available_memory)
    is how tests make the machine small."""
    found = (reader or available_memory)()
    if found is None:
        return None
    per_rank = max(1, int(found.bytes * fraction) // max(1, nproc))
    return DefaultBudget(per_rank, found, fraction, max(1, nproc))
