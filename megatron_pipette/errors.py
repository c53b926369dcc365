"""The two kinds of failure the planner distinguishes.

`PipetteError` is a user error (a bad flag or input file): the CLI and the hook
print its message and stop, never a traceback. `Infeasible` is a layout that
cannot run (it does not fit, or Megatron would reject it): the search counts
and reports it and moves on. Internal invariants use `assert`.
"""


class PipetteError(ValueError):
    """Bad user input. The message names the flag (or file field) and its value."""


class Infeasible(Exception):
    """A layout that cannot run, with a human reason ("stage 0 needs 91.2 GiB of 80.0 GiB")."""
