"""What a request can be refused with before it reaches the engine; app.py maps each to its status."""
from __future__ import annotations


class ValidationError(ValueError):
    """The request is malformed; answered with 400 and this message (`param`: the request's field, when known). A
    grammar that does not compile (master.grammar.GrammarError) is answered the same way. Raised inside a request
    model's validator, it comes out of api.base.validate as it is, its path in the body put before its message."""

    def __init__(self, message: str, param=None):
        super().__init__(message)
        self.param = param


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve; answered with 404."""


class EngineFailedError(RuntimeError):
    """The engine failed a request whose reply is whole or nothing (an embedding, a rerank's judgement): answered
    with 500 and the engine's reason."""
