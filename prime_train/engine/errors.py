"""The engine's error for what a user can fix: its own module, so that every engine module can raise it."""


class EngineConfigError(ValueError):
    """A setting or an input the engine cannot run with (a key, a data file and its line, a checkpoint to resume
    from); the job exits 78 and is never retried. A ValueError, as such problems were raised before."""
