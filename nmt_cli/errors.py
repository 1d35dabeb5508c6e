"""The one exception type for mistakes a user can fix; the CLI prints it as one line."""


class NmtError(Exception):
    """A user-facing error: its message names what is wrong, where, and the fix."""


class Stopped(Exception):
    """A search given up between two steps because nobody waits for its answers any more (the
    server's clients left or passed their deadline)."""
