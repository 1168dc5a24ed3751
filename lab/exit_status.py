"""The exit status of every ``python -m lab`` command: the same three meanings everywhere."""

EXIT_OK = 0
"""Done, or (preflight) ``pulumi up`` can go ahead."""
EXIT_FAILED = 1
"""The run or a check failed, or Azure could not be reached."""
EXIT_BAD_INPUT = 2
"""A flag, a scenario or the stack config is wrong; nothing was started."""
