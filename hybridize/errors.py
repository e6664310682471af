"""The one exception type the CLI turns into a one-line message (no stack trace)."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong and what to do."""
