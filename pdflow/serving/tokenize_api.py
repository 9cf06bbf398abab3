"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a completion's ``prompt`` (text) or a chat's ``messages`` (templated as the chat
endpoint would, with ``add_generation_prompt``) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` with ``return_token_strs``); ``/detokenize`` takes ``tokens`` and
answers ``{"prompt"}``. Both take the API key like the rest, and refuse a bad field with a 400
naming it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdflow.serving.openai_protocol import SERVED_MODEL, VOCAB_ID, ApiError, ChatMessage, exactly_one, parse_body, template_messages
from pdflow.serving.openapi import ERRORS


_MODEL = Field(default=None, json_schema_extra={SERVED_MODEL: True})
_SCHEMA, _CHECK = exactly_one(("prompt", "messages"))


class TokenizeRequest(BaseModel):
    """Exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_SCHEMA)
    model: str | None = _MODEL
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # for a prompt: as the completion endpoint tokenizes it
    return_token_strs: bool = False
    _one = model_validator(mode="before")(classmethod(lambda cls, body: _CHECK(body)))


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = _MODEL
    tokens: list[Annotated[int, Field(ge=0, json_schema_extra={VOCAB_ID: True})]]


def _doc(model: type[BaseModel], answer: dict) -> dict:
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}},
            "responses": {"200": {"description": "The answer.", "content": {"application/json": {"schema": answer}}},
                          **{status: ERRORS[status] for status in ("400", "401", "413")}}}


_TOKENIZE_ANSWER = {"type": "object", "required": ["count", "max_model_len", "tokens"],
                    "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                   "tokens": {"type": "array", "items": {"type": "integer"}},
                                   "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}}
_DETOKENIZE_ANSWER = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
MODELS = (TokenizeRequest, DetokenizeRequest)


def install(app: FastAPI, ingress, read: Callable[[Request], Awaitable[bytes]]) -> None:
    def check_model(name: str | None) -> None:
        if name is not None and name != ingress.served_name:
            raise ApiError(f"model: unknown model {name!r}; this server serves {ingress.served_name!r}",
                           param="model", code="model_not_found")

    @app.post("/tokenize", summary="Token ids of a prompt or of chat messages (vLLM's)", tags=["tokens"],
              **_doc(TokenizeRequest, _TOKENIZE_ANSWER))
    async def tokenize(request: Request) -> dict:
        req = parse_body(TokenizeRequest, await read(request))
        check_model(req.model)
        if req.messages is not None:
            ids = await ingress.prompts.chat_messages(template_messages(req.messages), req.add_generation_prompt)
        else:
            ids = await ingress.prompts.completion(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [ingress.token_texts(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": ingress.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", summary="The text of token ids (vLLM's)", tags=["tokens"],
              **_doc(DetokenizeRequest, _DETOKENIZE_ANSWER))
    async def detokenize(request: Request) -> dict:
        req = parse_body(DetokenizeRequest, await read(request))
        check_model(req.model)
        return {"prompt": await ingress.prompts.text(req.tokens)}
