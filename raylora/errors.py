"""The error raylora raises for bad configuration or input, below every module that raises it.

`raylora.config` re-exports it (`from raylora.config import ConfigError` is how the rest of raylora reads it);
it lives here so that `raylora.config_checks` can raise it without importing `raylora.config`, which calls
those checks when it loads a config.
"""


class ConfigError(ValueError):
    """Bad configuration or input, found before any expensive work starts (the CLI exits with 2)."""
