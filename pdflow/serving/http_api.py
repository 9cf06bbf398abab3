"""The OpenAI-compatible HTTP API that ingress serves (FastAPI; OpenAPI document at
``/openapi.json``, rendered at ``/docs``).

Every refusal is a 4xx in OpenAI's error format naming the field at fault: a missing or wrong API
key (401), a body over ``server.max_body_bytes`` (413, refused before it is read), a bad field
(400), too many requests in flight (429). ``GET /metrics`` serves Prometheus metrics
(:mod:`pdflow.serving.metrics`), behind the API key like the rest. Prompts are templated and
tokenized off the event loop (:mod:`pdflow.serving.prompts`).
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdflow import __version__
from pdflow.messages import RequestFailed, SamplingParams, TextDelta
from pdflow.serving.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_request_id,
    parse_chat_request,
    parse_completion_request,
    sampling_from,
    sse,
    usage_chunk,
)
from pdflow.serving.admin_api import install_admin
from pdflow.serving.closing_stream import ClosingStreamingResponse
from pdflow.serving.metrics import CONTENT_TYPE
from pdflow.serving.openapi import install_openapi, route_doc


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

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        ingress.metrics.refusal(exc.status)
        return JSONResponse(error_body(exc), status_code=exc.status)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            if request.url.path not in _OPEN_PATHS:
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
        return await _serve(ingress, request, req, prompt_ids, chat=True)

    @app.post("/v1/completions", **route_doc(CompletionRequest, "text_completion"))
    async def completions(request: Request):
        req = parse_completion_request(await read_body(request, limit))
        prompt_ids = await ingress.prompts.completion(req)
        return await _serve(ingress, request, req, prompt_ids, chat=False)

    install_admin(app, ingress, lambda request: read_body(request, limit))
    install_openapi(app)
    return app


def _params(ingress, req, prompt_len: int, chat: bool) -> tuple[SamplingParams, dict]:
    if req.model is not None and req.model != ingress.served_name:
        raise ApiError(f"model: unknown model {req.model!r}; this server serves {ingress.served_name!r}",
                       param="model", code="model_not_found")
    context = ingress.max_context
    if prompt_len >= context:
        raise ApiError(
            f"{'messages' if chat else 'prompt'}: the prompt has {prompt_len} tokens; "
            f"the model's context is {context} tokens",
            param="messages" if chat else "prompt", code="context_length_exceeded")
    s = sampling_from(req)
    max_tokens = s["max_tokens"]
    if max_tokens is None:
        max_tokens = context - prompt_len
    elif prompt_len + max_tokens > context:
        raise ApiError(
            f"max_tokens: {max_tokens} + the prompt's {prompt_len} tokens exceed the model's context "
            f"of {context} tokens", param="max_tokens", code="context_length_exceeded")
    params = SamplingParams(max_tokens, s["temperature"], s["top_p"], s["top_k"], s["seed"],
                            s["stop_token_ids"], s["ignore_eos"])
    return params, s


async def _serve(ingress, http: Request, req: ChatCompletionRequest | CompletionRequest,
                 prompt_ids: list[int], chat: bool):
    params, s = _params(ingress, req, len(prompt_ids), chat)
    request_id = new_request_id(chat)
    pending = await ingress.submit(request_id, prompt_ids, params, s["stop"], s["skip_special_tokens"],
                                   kv_ttl_s=s["kv_ttl_s"])
    try:
        results = _results(ingress, pending)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return ClosingStreamingResponse(_stream(ingress, pending, results, chat, include_usage),
                                            media_type="text/event-stream")
        return await _collect(ingress, http, pending, results, chat)
    except BaseException:  # whatever raised, the request holds no slot after it (idempotent)
        ingress.cancel_request(pending, "failed")
        raise


async def _results(ingress, pending):
    """The request's deltas until it finishes; raises ApiError when it fails or times out."""
    deadline = pending.received + ingress.limits.request_timeout_s
    while True:
        try:
            item = await asyncio.wait_for(pending.queue.get(), deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise ApiError(f"request timed out after {ingress.limits.request_timeout_s} s",
                           status=504, type="timeout") from None
        if isinstance(item, RequestFailed):
            raise ApiError(f"{item.stage}: {item.message}", status=503, type="server_error")
        yield item
        if item.finish_reason is not None:
            return


async def _collect(ingress, http: Request, pending, results, chat: bool):
    async def gather() -> TextDelta:
        parts, last = [], None
        async for delta in results:
            parts.append(delta.text)
            last = delta
        return last, "".join(parts)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            ingress.cancel_request(pending, "client disconnected")
            return JSONResponse({}, status_code=499)
        try:
            last, text = work.result()
        except ApiError:
            ingress.cancel_request(pending, "failed")
            raise
    finally:
        watch.cancel()
    ingress.finish(pending, last.timeline)
    build = chat_response if chat else completion_response
    body = build(pending.request_id, ingress.served_name, text, last.finish_reason,
                 pending.prompt_len, last.completion_tokens, pending.cached_tokens, pending.drafts)
    return JSONResponse(body)


async def _stream(ingress, pending, results, chat: bool, include_usage: bool):
    rid, model, created = pending.request_id, ingress.served_name, int(time.time())
    finished = False
    try:
        if chat:
            yield sse(chat_chunk(rid, model, created, "", None, role_first=True))
        last = None
        async for delta in results:
            last = delta
            if delta.text:
                yield sse(chat_chunk(rid, model, created, delta.text, None) if chat
                          else completion_chunk(rid, model, created, delta.text, None))
        yield sse(chat_chunk(rid, model, created, None, last.finish_reason) if chat
                  else completion_chunk(rid, model, created, "", last.finish_reason))
        if include_usage:
            yield sse(usage_chunk(rid, model, created, pending.prompt_len, last.completion_tokens, chat,
                                  pending.cached_tokens, pending.drafts))
        yield sse("[DONE]")
        finished = True
        ingress.finish(pending, last.timeline)
    except ApiError as exc:
        yield sse(error_body(exc))
    finally:
        if not finished:
            ingress.cancel_request(pending, "client disconnected or failed")
