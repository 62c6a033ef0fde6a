"""shardbound: ONNX -> sharded, deterministic bound-propagation programs.

The components live in top-level folders of the repository (compiler/, passes/, runtime/,
templates/) and are mapped into this namespace by pyproject.toml.
"""

__version__ = "0.1.0"
