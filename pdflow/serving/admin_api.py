"""The admin endpoints ingress serves besides the OpenAI API.

``POST /admin/kv/forget`` drops stored KV everywhere it is kept (every kv-shuttle replica's memory
and disk tiers, the colocated worker's store): the KV of a prefix and every block built on it,
given as a chat body's ``messages`` or a completion body's ``prompt`` (text or token ids), or
``{"all": true}``. What a prefix is is exactly what the chat or completion endpoint would have
computed for that body, so a user's conversation is forgotten by sending its first turn. Blocks of
the prefix that other conversations share (a common system prompt of a block or more) are
dropped too, with everything built on them: those recompute; forgetting errs on the side of
forgetting. Answers 200 with what each replica dropped, or 503 naming the replicas that did not
answer in time (retry: a replica that was down still holds its KV).

It takes the API key like every other endpoint (``security.api_key_*``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdflow.serving.openai_protocol import ApiError, parse_chat_request, parse_completion_request
from pdflow.serving.openapi import ERRORS

_CHOICES = ("messages", "prompt", "all")

_FORGET_BODY = {"oneOf": [
    {"type": "object", "required": ["messages"], "description": "A chat body's messages: that prompt's prefix.",
     "properties": {"messages": {"type": "array", "minItems": 1,
                                 "items": {"$ref": "#/components/schemas/ChatMessage"}}}},
    {"type": "object", "required": ["prompt"], "description": "A completion body's prompt: text or token ids.",
     "properties": {"prompt": {"oneOf": [{"type": "string"},
                                         {"type": "array", "items": {"type": "integer", "minimum": 0}}]}}},
    {"type": "object", "required": ["all"], "description": "Everything.",
     "properties": {"all": {"type": "boolean", "enum": [True]}}},
]}
_FORGET_DOC = {
    "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": _FORGET_BODY}}}},
    "responses": {
        "200": {"description": "What each replica that keeps KV dropped (blocks in memory and on disk).",
                "content": {"application/json": {"schema": {"type": "object"}}}},
        **{status: ERRORS[status] for status in ("400", "401", "413")},
        "503": {"description": "Some replicas did not answer in time (`unreached` names them): retry.",
                "content": {"application/json": {"schema": {"type": "object"}}}},
    },
}


def install_admin(app: FastAPI, ingress, read: Callable[[Request], Awaitable[bytes]]) -> None:
    @app.post("/admin/kv/forget", summary="Forget stored KV: a prefix and all built on it, or everything",
              tags=["admin"], **_FORGET_DOC)
    async def forget_kv(request: Request) -> JSONResponse:
        body = await read(request)
        try:
            raw = json.loads(body)
        except ValueError as exc:
            raise ApiError(f"invalid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ApiError("the request body must be a JSON object")
        given = [name for name in _CHOICES if name in raw]
        if len(given) != 1:
            raise ApiError(f"body: give exactly one of {', '.join(_CHOICES)}; got "
                           f"{', '.join(given) if given else 'none'}", param=given[-1] if given else "body")
        if given == ["all"]:
            if raw["all"] is not True:
                raise ApiError("all: expected true (to forget everything)", param="all")
            prompt_ids = None
        elif given == ["messages"]:
            prompt_ids = await ingress.prompts.chat(parse_chat_request(body))
        else:
            prompt_ids = await ingress.prompts.completion(parse_completion_request(body))
        result = await ingress.forget_kv(prompt_ids)
        bt = ingress.pipeline.kv.block_tokens
        answer = {"object": "kv.forget", "everything": prompt_ids is None,
                  **({} if prompt_ids is None else {"prefix_tokens": len(prompt_ids),
                                                     "prefix_blocks": len(prompt_ids) // bt}),
                  **result}
        return JSONResponse(answer, status_code=503 if result["unreached"] else 200)
