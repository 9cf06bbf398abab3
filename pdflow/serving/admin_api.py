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

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdflow.serving.openai_protocol import (
    ONE_PROMPT,
    ApiError,
    ChatMessage,
    CompletionRequest,
    exactly_one,
    parse_body,
    template_messages,
)
from pdflow.serving.openapi import ERRORS

_CHOICES = ("messages", "prompt", "all")


_SCHEMA, _CHECK = exactly_one(_CHOICES)


class ForgetRequest(BaseModel):
    """Exactly one of: a chat body's ``messages`` (that prompt's prefix), a completion body's
    ``prompt`` (one: text or token ids), ``all`` (everything)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_SCHEMA)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: Any = Field(default=None, json_schema_extra=ONE_PROMPT)
    all: Literal[True] | None = None
    _one = model_validator(mode="before")(classmethod(lambda cls, body: _CHECK(body)))


_FORGET_DOC = {
    "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ForgetRequest"}}}}},
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
        req = parse_body(ForgetRequest, await read(request))
        if req.all:
            prompt_ids = None
        elif req.messages is not None:
            prompt_ids = await ingress.prompts.chat_messages(template_messages(req.messages))
        else:
            prompts = parse_body(CompletionRequest, msgspec.json.encode({"prompt": req.prompt})).prompts()
            if len(prompts) != 1:
                raise ApiError("prompt: give one prompt to forget", param="prompt")
            prompt_ids = await ingress.prompts.completion(prompts[0])
        result = await ingress.forget_kv(prompt_ids)
        bt = ingress.pipeline.kv.block_tokens
        answer = {"object": "kv.forget", "everything": prompt_ids is None,
                  **({} if prompt_ids is None else {"prefix_tokens": len(prompt_ids),
                                                     "prefix_blocks": len(prompt_ids) // bt}),
                  **result}
        return JSONResponse(answer, status_code=503 if result["unreached"] else 200)
