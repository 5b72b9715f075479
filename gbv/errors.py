"""User-facing errors: one line that says what is wrong and how to fix it (CLI exit code 2)."""


class GbvError(ValueError):
    """Bad input from the user. The CLI prints ``gbv: error: <message>`` and exits with code 2."""
