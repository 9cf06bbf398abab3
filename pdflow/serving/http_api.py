"""The OpenAI-compatible HTTP API that ingress serves (FastAPI; OpenAPI document at
``/openapi.json``, rendered at ``/docs``).

Every refusal is a 4xx in OpenAI's error format naming the field at fault: a missing or wrong API
key (401), a body over ``server.max_body_bytes`` (413, refused before it is read), a bad field
(400), too many requests in flight (429). ``GET /metrics`` serves Prometheus metrics
(:mod:`pdflow.serving.metrics`), behind the API key like the rest unless
``server.metrics_open``. Prompts are templated and tokenized off the event loop
(:mod:`pdflow.serving.prompts`).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdflow import __version__
from pdflow.serving.admin_api import ForgetRequest, install_admin
from pdflow.serving.choices import serve
from pdflow.serving.metrics import CONTENT_TYPE
from pdflow.serving.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_chat_request,
    parse_completion_request,
)
from pdflow.serving.openapi import install_openapi, route_doc
from pdflow.serving import tokenize_api


# a replica in one of these states is as it should be (the scaler's parked, draining and joining
# ones included); any other (starting, restarting) makes /health degraded
SERVING_STATES = ("ready", "parked", "draining", "joining")
_OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; ApiError 413 as soon as it is known to exceed ``limit`` bytes."""
    def too_large(size: str) -> ApiError:
        return ApiError(f"body: the request body has {size} bytes; this server takes at most {limit} "
                        "(server.max_body_bytes)", status=413, param="body", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(ingress) -> FastAPI:
    app = FastAPI(title="pdflow", version=__version__, description="Disaggregated LLM inference")
    api_key = getattr(ingress, "api_key", None)
    limit = ingress.pipeline.server.max_body_bytes
    open_paths = (*_OPEN_PATHS, "/metrics") if ingress.pipeline.server.metrics_open else _OPEN_PATHS

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        ingress.metrics.refusal(exc.status)
        return JSONResponse(error_body(exc), status_code=exc.status)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            if request.url.path not in open_paths:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    error = ApiError("authorization: a valid API key is required (Authorization: Bearer <key>)",
                                     status=401, param="authorization", code="invalid_api_key")
                    ingress.metrics.refusal(401)
                    return JSONResponse(error_body(error), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        down = sorted(f"{stage}-{replica}" for stage, replica in ingress.down)
        stages = ingress.stage_status
        all_ready = len(stages) == len(ingress.pipeline.replicas()) and all(
            s["state"] in SERVING_STATES for s in stages.values()
        )
        ok = ingress.accepting and not down and all_ready
        body = {"status": "ok" if ok else "degraded", "down": down, "in_flight": len(ingress.requests),
                "stages": stages}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics (text exposition format)", tags=["admin"],
             response_class=Response, responses={"200": {"content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        return Response(ingress.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": ingress.served_name, "object": "model", "created": 0, "owned_by": "pdflow",
                "max_model_len": ingress.max_context}
        return {"object": "list", "data": [card]}

    @app.get("/debug/timeline/{request_id}")
    async def timeline(request_id: str) -> dict:
        found = ingress.timelines.get(request_id)
        if found is None:
            raise ApiError(f"no timeline for {request_id!r} (only the last finished requests are kept)",
                           status=404, param="request_id")
        return found

    @app.post("/v1/chat/completions", **route_doc(ChatCompletionRequest, "chat.completion"))
    async def chat_completions(request: Request):
        req = parse_chat_request(await read_body(request, limit))
        prompt_ids = await ingress.prompts.chat(req)
        return await serve(ingress, request, req, [prompt_ids], chat=True)

    @app.post("/v1/completions", **route_doc(CompletionRequest, "text_completion"))
    async def completions(request: Request):
        req = parse_completion_request(await read_body(request, limit))
        prompts = req.prompts()
        many = len(prompts) > 1
        ids = [await ingress.prompts.completion_ids(p, f"prompt.{i}" if many else "prompt")
               for i, p in enumerate(prompts)]
        echoes = None
        if req.echo:  # the prompt's text before each completion (a token prompt's as it decodes)
            echoes = [p if isinstance(p, str) else await ingress.prompts.text(p) for p in prompts]
        return await serve(ingress, request, req, ids, chat=False, echoes=echoes)

    install_admin(app, ingress, lambda request: read_body(request, limit))
    tokenize_api.install(app, ingress, lambda request: read_body(request, limit))
    install_openapi(app, (*tokenize_api.MODELS, ForgetRequest), ingress.served_name, ingress.vocab_size)
    return app
