"""The OpenAPI document of the HTTP API: complete and valid, so that schema-driven clients and
fuzzers (schemathesis) can use it.

The endpoints parse their bodies themselves (for OpenAI-shaped errors naming the field), so
FastAPI does not see the request models: :func:`route_doc` describes each endpoint's body and every
status it can answer with, and :func:`install_openapi` puts the schemas those descriptions refer
to (the request models with their nested ones, the error body, the responses) in the document's
``components``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pdflow.serving.openai_protocol import (
    SERVED_MODEL,
    VOCAB_ID,
    VOCAB_ID_TEXT,
    ChatCompletionRequest,
    CompletionRequest,
)

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(model=name)}


ERROR_RESPONSE = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "completion_tokens_details": {
            "type": "object", "description": "with speculative decoding: draft tokens kept and rejected",
            "properties": {"accepted_prediction_tokens": {"type": "integer"},
                           "rejected_prediction_tokens": {"type": "integer"}}},
    },
}


def _completion_schema(obj: str) -> dict:
    chat = obj == "chat.completion"
    answer = ({"message": {"type": "object", "required": ["role", "content"],
                           "properties": {"role": {"type": "string"}, "content": {"type": ["string", "null"]}}}}
              if chat else {"text": {"type": "string"}})
    choice = {"type": "object", "required": ["index", "finish_reason", *answer],
              "properties": {"index": {"type": "integer"}, **answer,
                             "logprobs": {"type": ["object", "null"], "description": "OpenAI's shape for "
                                          + ("chat: content[]" if chat else "completions: tokens, token_logprobs, "
                                             "top_logprobs, text_offset")},
                             "finish_reason": {"type": ["string", "null"]}}}
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": [obj]},
                       "created": {"type": "integer"}, "model": {"type": "string"},
                       "system_fingerprint": {"type": "string"},
                       "choices": {"type": "array", "items": choice}, "usage": _ref("Usage")},
    }


# an event of the stream (OpenAPI < 3.2: the schema of a text/event-stream describes each event)
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, an error, or [DONE]"},
                   "event": {"type": "string"}},
}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref("ErrorResponse")}}}


ERRORS = {
    "400": _error("A field is invalid; `error.param` names it."),
    "401": _error("The server has an API key and the request did not send it (`Authorization: Bearer <key>`)."),
    "413": _error("The body is larger than `server.max_body_bytes`."),
    "429": _error("Too many requests in flight (`limits.max_queued_requests`); retry later."),
    "503": _error("A stage failed the request, none of a stage's replicas is up, or the server is stopping."),
    "504": _error("The request took longer than `limits.request_timeout_s`."),
}


def route_doc(model: type, obj: str) -> dict:
    """The ``@app.post`` arguments that describe an endpoint whose body is ``model``."""
    ok = {"description": "The answer; with `stream: true`, server-sent events of chunks ending in `[DONE]`.",
          "content": {"application/json": {"schema": _ref(f"{model.__name__}Response")},
                      "text/event-stream": {"schema": SSE_EVENT}}}
    return {
        "openapi_extra": {"requestBody": {"required": True,
                                          "content": {"application/json": {"schema": _ref(model.__name__)}}}},
        "responses": {"200": ok, **ERRORS},
    }


def _components(models) -> dict:
    schemas = {"ErrorResponse": ERROR_RESPONSE, "Usage": USAGE}
    for model in (ChatCompletionRequest, CompletionRequest, *models):
        schema = model.model_json_schema(ref_template=_REF)
        for name, values in getattr(model, "neutral", {}).items():
            schema["properties"].setdefault(name, {
                "enum": _distinct(values), "description": "Not supported: refused (400) unless one of these values, "
                "which change nothing."})
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    for model, obj in ((ChatCompletionRequest, "chat.completion"), (CompletionRequest, "text_completion")):
        schemas[f"{model.__name__}Response"] = _completion_schema(obj)
    return schemas


def _distinct(values: tuple) -> list:
    """``values`` without repeats as JSON sees them (1 and 1.0 are one number; True is not 1)."""
    out: list = []
    for value in values:
        if not any(value == kept and isinstance(value, bool) == isinstance(kept, bool) for kept in out):
            out.append(value)
    return out


def integers_below(n: int) -> str:
    """A regular expression of the decimal texts of the integers in ``[0, n)``, without leading
    zeros (``n`` >= 1)."""
    top = str(n - 1)
    shorter = ["0", "[1-9]"] + ([f"[1-9][0-9]{{1,{len(top) - 2}}}"] if len(top) > 2 else [])
    if len(top) == 1:
        shorter = ["0"] if top == "0" else [f"[0-{top}]"]
        return f"^({'|'.join(shorter)})$"
    same = []
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            same.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    same.append(top)
    return f"^({'|'.join(shorter + same)})$"


def _served(node, served_name: str, vocab: int) -> None:
    """Fill in the marks the request models leave (:data:`SERVED_MODEL`, :data:`VOCAB_ID`,
    :data:`VOCAB_ID_TEXT`) with what this server takes."""
    if isinstance(node, list):
        for item in node:
            _served(item, served_name, vocab)
        return
    if not isinstance(node, dict):
        return
    if node.pop(SERVED_MODEL, False):
        node["anyOf"] = [{"type": "string", "enum": [served_name]}, {"type": "null"}]
    if node.pop(VOCAB_ID, False):
        node["maximum"] = vocab - 1
    if node.pop(VOCAB_ID_TEXT, False):
        node.update({"type": "string", "pattern": integers_below(vocab)})
    for value in node.values():
        _served(value, served_name, vocab)


def install_openapi(app: FastAPI, models: tuple = (), served_name: str | None = None, vocab: int = 2**31) -> None:
    """Serve a document whose every ``$ref`` resolves (the request models' nested schemas too;
    ``models``: the request bodies of other endpoints), stating what this server takes: its model's
    name (``served_name``), token ids below ``vocab``."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(_components(models))
            _served(document["components"]["schemas"], served_name, vocab)
            _document_open_routes(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


def _document_open_routes(document: dict) -> None:
    """The statuses of the small routes that FastAPI cannot infer."""
    paths = document["paths"]
    health = paths.get("/health", {}).get("get")
    if health is not None:
        health["responses"]["503"] = {"description": "Degraded: a replica is down, starting or restarting, "
                                      "or the server is stopping.",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}
    for path, item in paths.items():
        for operation in item.values():
            if path.startswith(("/v1/", "/debug/", "/tokenize", "/detokenize")):
                operation["responses"].setdefault("401", ERRORS["401"])
            if path.startswith("/debug/timeline/"):
                operation["responses"]["404"] = _error("No timeline is kept for that id.")
