"""The project's exception types. Every error a user can cause raises one of these with a message
that says what to do."""


class MmOvalError(Exception):
    """Base class of every error mm-oval raises on purpose."""


class ConfigError(MmOvalError, ValueError):
    """A knob is out of range or two knobs contradict each other."""


class ModelError(MmOvalError, TypeError):
    """The model is not one mm-oval supports, or a learned part belongs to another model."""


class DataError(MmOvalError, ValueError):
    """A data file is missing, corrupt or in the wrong format (the message names file and row)."""


class ResultsError(MmOvalError, RuntimeError):
    """An output directory holds results that do not match the requested run."""
