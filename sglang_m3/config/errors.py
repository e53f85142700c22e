"""The one error type of config reading."""


class M3ConfigError(ValueError):
    """A config value the model cannot run with; the message names the field and what is accepted."""
