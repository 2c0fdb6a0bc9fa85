"""The replica's one error type, from the engine to the wire.

`ReplicaError(code, message, type_, param)` is what the engine, the adapter manager, the round
participant and the NATS endpoints raise when they refuse or fail a request: `code` is HTTP-like (400 bad
input, 404 unknown adapter or job, 409 conflict, 422 unusable adapter, 429 queue full, 500 internal,
503 unavailable), `type` the OpenAI error type the gateway passes on, `param` the request field at fault.
It is a `collm_common.bus.ServiceFailure`, so the bus's endpoint wrapper (`MicroService.endpoint` /
`stream_endpoint`) is the one place that turns it into a wire error reply: micro's error headers
(`Nats-Service-Error`, `Nats-Service-Error-Code`) plus the endpoint's error body.

`NotResident` is the one refusal a caller is expected to recover from: the adapter version a request
names is not in the engine's slots, and the adapter manager can make it resident.
"""

from __future__ import annotations

from collm_common.bus import ServiceFailure
from collm_common.wire.inference import CONTEXT_LENGTH_EXCEEDED


class ReplicaError(ServiceFailure):
    """A refused or failed request: HTTP-like `code`, OpenAI error `type`, `message`, offending `param`
    (`ReplicaError(code, message, type_="invalid_request_error", param=None)`)."""


class NotResident(ReplicaError):
    """The adapter (version) a request names is in no engine slot (503 until made resident)."""

    def __init__(self, version: str) -> None:
        super().__init__(503, f"{version} is not resident", "service_unavailable", param="model")
        self.version = version


def context_length_exceeded(
    limit: int, prompt_tokens: int, max_tokens: int, param: str | None = None, prompt_chars: int | None = None
) -> ReplicaError:
    """400 `context_length_exceeded` in vLLM's words, which clients match to tell a context overflow from
    other bad input. `prompt_chars`: the prompt was not tokenized, `prompt_tokens` is a lower bound from
    its characters."""
    least = "at least " if prompt_chars is not None else ""
    where = f"in the prompt of {prompt_chars} characters" if prompt_chars is not None else "in the prompt"
    return ReplicaError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested {least}"
        f"{prompt_tokens + max_tokens} tokens ({least}{prompt_tokens} {where}, {max_tokens} in the "
        "completion). Please reduce the length of the prompt or completion.",
        param=param,
        error_code=CONTEXT_LENGTH_EXCEEDED,
    )
