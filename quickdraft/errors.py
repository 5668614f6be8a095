"""The exceptions users see. Each message says what was expected and what was found.

Everything else (asserts) guards internal invariants only.
"""


class QuickdraftError(Exception):
    """Base class: the CLI and server print these without a traceback."""


class ModelLoadError(QuickdraftError):
    """A model file or directory is missing, truncated or malformed."""


class UnsupportedArchitecture(ModelLoadError):
    """The checkpoint is readable but describes a model family quickdraft does not run."""


class ContextTooLong(QuickdraftError):
    """A prompt (plus the tokens asked for) does not fit the model's context or the cache."""


class InvalidSamplingParams(QuickdraftError, ValueError):
    """A sampling setting is out of range or of the wrong type."""
