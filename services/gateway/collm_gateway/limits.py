"""Request body size limit as pure ASGI middleware, refusing with 413 in the OpenAI envelope.

A declared `Content-Length` over the limit is refused before any byte is read; a chunked body is
counted as it arrives and refused as soon as it passes the limit. (Starlette's own limiter answers in
plain text, which OpenAI clients cannot parse.)
"""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from collm_gateway import metrics
from collm_gateway.errors import APIError, from_http_status


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(send, declared)
            return
        seen = 0
        limit = self.max_body_bytes

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # FastAPI re-raises HTTPException from reading the body; our handler writes the envelope.
                    raise HTTPException(413, f"more than {limit} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _refuse(self, send: Send, declared: int) -> None:
        err = from_http_status(413, f"{declared} bytes declared, the limit is {self.max_body_bytes}")
        await send_api_error(send, err)


async def send_api_error(send: Send, err: APIError) -> None:
    """Answer with `err` (status, headers, OpenAI envelope) straight from ASGI middleware; a 4xx is
    counted as a refusal (metrics.REFUSED)."""
    metrics.count_refusal(err.status, err.code)
    body = json.dumps(err.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
