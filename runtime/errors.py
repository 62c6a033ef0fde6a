"""User-facing errors: one line that names the file, node or field and says what to do.

The base class lives in the runtime (the lowest layer) so that generated programs, which import
only `shardbound.runtime`, raise the same error type as the compiler."""


class ShardboundError(Exception):
    """An error caused by user input (a model, a property, a box, a flag). The CLI prints it as
    one line and exits with code 2; it never shows a traceback."""
