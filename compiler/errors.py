"""User-facing errors: one line that names the file, node or field and says what to do.

Re-exported from the runtime so that compiler and generated programs share one error type."""

from shardbound.runtime.errors import ShardboundError

__all__ = ["ShardboundError"]
