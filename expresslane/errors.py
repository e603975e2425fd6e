"""User-facing exceptions: each message names the file, field or parameter and what was expected.

The CLI prints them on one line and exits 2; the server maps them to OpenAI-shaped 4xx answers.
Anything else that escapes is a bug and keeps its traceback.
"""


class ExpressLaneError(Exception):
    """Base class of every error caused by the user's input rather than by a bug."""

    status_code = 400


class ConfigError(ExpressLaneError):
    """A config.json (or a CLI flag that fills a config) breaks a rule."""


class CheckpointError(ExpressLaneError):
    """A checkpoint folder is missing, unreadable, unsafe, or does not match its config."""


class TokenizerError(ExpressLaneError):
    """Tokenizer files are missing or malformed, or a chat template fails to render."""


class RequestError(ExpressLaneError):
    """A generation request is malformed (bad sampling values, prompt too long, bad token ids)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.param = param
        self.status_code = status_code
