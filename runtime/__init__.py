"""What generated programs import: bound kernels, the engine, loading, boxes and reports.

No ONNX and no jinja2 here: a compiled program runs with torch, safetensors and this package.
"""

from shardbound.runtime.errors import ShardboundError
from shardbound.runtime.program.loader import Verifier, load

__all__ = ["ShardboundError", "Verifier", "load"]
