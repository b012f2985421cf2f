"""The one exception type that the CLI turns into a clean message instead of a stack trace."""


class HeadwayError(Exception):
    """Bad input or state a user can act on; the message names the problem and the fix."""
