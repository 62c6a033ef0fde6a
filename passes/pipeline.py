"""The ordered pass list for each mode."""

from __future__ import annotations

from shardbound.passes.bound_plan import bound_plan
from shardbound.passes.canonicalize import canonicalize
from shardbound.passes.fsdp_schedule import fsdp_schedule
from shardbound.passes.memory_plan import memory_plan
from shardbound.passes.summation_order import summation_order
from shardbound.passes.tp_zones import tp_zones
from shardbound.passes.manager import Pass, PassManager

_COMMON = [Pass("canonicalize", canonicalize), Pass("bound_plan", bound_plan),
           Pass("summation_order", summation_order)]

PIPELINES = {
    "single": _COMMON + [Pass("memory_plan", memory_plan)],
    "fsdp": _COMMON + [Pass("fsdp_schedule", fsdp_schedule), Pass("memory_plan", memory_plan)],
    "tp": [Pass("canonicalize", canonicalize), Pass("bound_plan", bound_plan),
           Pass("tp_zones", tp_zones), Pass("summation_order", summation_order),
           Pass("memory_plan", memory_plan)],
}


def pipeline(mode: str, verify_each: bool = False) -> PassManager:
    if mode not in PIPELINES:
        raise ValueError(f"unknown mode {mode!r}")
    return PassManager(list(PIPELINES[mode]), verify_each=verify_each)
