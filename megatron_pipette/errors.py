"""The two kinds of failure the planner distinguishes.

`PipetteError` is a user error (a bad flag or input file): the CLI prints its message
and stops, never a traceback; the hook warns and trains with the user's own flags
(stops with --auto-parallel-strict), or, for `UnrunnableFlags`, which those flags would
only crash on, stops (and for `UnresumableCheckpoint`, a checkpoint no layout can load).
`Infeasible` is a layout that cannot run (it does not fit, or
Megatron would reject it): the search counts and reports it and moves on. Internal
invariants use `assert`.
"""


class PipetteError(ValueError):
    """Bad user input. The message names the flag (or file field) and its value."""


class Infeasible(Exception):
    """A layout that cannot run, with a human reason ("stage 0 needs 91.2 GiB of 80.0 GiB")."""


class UnrunnableFlags(PipetteError):
    """The user's own flags cannot run in this installation (Megatron would stop every rank on an
    assertion): falling back to them is no way out, so the hook stops with this message."""


class UnresumableCheckpoint(UnrunnableFlags):
    """No layout this job can run can load the checkpoint in --load (or it cannot be read): Megatron
    would stop every rank in load_checkpoint, at every restart, so the hook stops first with this message."""
