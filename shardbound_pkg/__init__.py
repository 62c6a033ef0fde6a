"""shardbound: ONNX -> sharded, deterministic bound-propagation programs.

The components live in top-level folders of the repository (compiler/, passes/, runtime/,
templates/) and are mapped into this namespace by pyproject.toml.

Importing shardbound asks MKL for its strict conditional-numerical-reproducibility mode
(MKL_CBWR=AUTO,STRICT) unless the user set MKL_CBWR: without it, MKL SGEMM results change with
the memory alignment of an operand (measured: a weight at a 4-byte offset gives other bits),
so an fsdp-gathered weight would not reproduce single mode. MKL reads the variable at its first
call, so this works even after `import torch`, as long as no matrix product ran before.
"""

import os as _os

_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
