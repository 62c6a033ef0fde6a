"""What generated programs import: bound kernels, the engine, loading, boxes and reports.

No ONNX and no jinja2 here: a compiled program runs with torch, safetensors and this package.
`load` and `Verifier` are looked up on first use (PEP 562), so importing a light module of
the runtime (errors, the program's entry points) does not load torch: `--help` stays instant.
"""

from shardbound.runtime.errors import ShardboundError

__all__ = ["ShardboundError", "Verifier", "load"]


def __getattr__(name):
    if name in ("Verifier", "load"):
        from shardbound.runtime.program import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
