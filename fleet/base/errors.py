"""User-facing errors: each carries one line that names the field and the fix.

The CLI prints ``error: <message>`` and exits with status 2 for any
:class:`FleetError`; anything else is a bug and keeps its traceback.
"""


class FleetError(Exception):
    """Base for errors caused by user input (files, flags, configs)."""


class ConfigError(FleetError):
    """An experiment config field has a bad value."""


class ProfileMismatchError(FleetError):
    """A device profile was measured on a different model or input shape."""


class ModelError(FleetError):
    """Unknown model name or a weights file that does not fit the model."""


class DataError(FleetError):
    """A dataset is missing on disk or a partition request cannot be met."""


class BudgetError(FleetError):
    """A time or memory budget that no plan can meet."""
