"""The exceptions users see. Each message says what was expected and what was found.

Everything else (asserts) guards internal invariants only.
"""


class QuickdraftError(Exception):
    """Base class: the CLI and server print these without a traceback."""


class ModelLoadError(QuickdraftError):
    """A model file or directory is missing, truncated or malformed."""


class UnsupportedArchitecture(ModelLoadError):
    """The checkpoint is readable but describes a model family quickdraft does not run."""


class RequestError(QuickdraftError):
    """A request that cannot be served as asked (requests/): `param` names the field at fault as
    OpenAI's API does, `code` says what kind of refusal it is; the server answers it with a 400
    carrying both, the Python API raises it as it is."""
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code or type(self).code


class NoChatTemplate(ModelLoadError, RequestError):
    """Chat messages sent to a model whose tokenizer has no chat template (`param`: messages)."""


class ContextTooLong(RequestError):
    """A prompt (plus the tokens asked for) does not fit the model's context or the cache."""
    code = "context_length_exceeded"


class InvalidSamplingParams(QuickdraftError, ValueError):
    """A sampling setting is out of range or of the wrong type."""
