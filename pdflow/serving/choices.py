"""One API request served as its choices: ``n`` per prompt (and, for completions, several
prompts), each an internal request of the pipeline, collected into one response or interleaved
into one stream.

Choice ``p * n + j`` is prompt ``p``'s ``j``-th. Choice 0 keeps the response's id; the others run
as ``<id>-<index>``. A prompt's choices share its first choice's route, so its KV is computed
once in that store and the others start from its blocks (the store's prefix reuse); with a
``seed``, choice ``j`` draws with ``seed + j``, so they differ and each is reproducible.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from msgspec.structs import replace

from fastapi import Request
from fastapi.responses import JSONResponse

from pdflow.guides import guide_error
from pdflow.messages import RequestFailed, SamplingParams, TextDelta, TokenLogprob
from pdflow.serving.closing_stream import ClosingStreamingResponse
from pdflow.serving.logprobs_format import CompletionLogprobs, chat_logprobs, joined
from pdflow.serving.openai_protocol import (
    SEED_MAX,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    sampling_from,
)
from pdflow.serving.openai_responses import (
    chat_choice,
    chat_chunk,
    completion_choice,
    completion_chunk,
    new_request_id,
    response,
    sse,
    usage,
    usage_chunk,
)

if TYPE_CHECKING:  # annotations only: the ingress stage imports this module
    from pdflow.stages.ingress import PendingRequest


@dataclass(slots=True, eq=False)
class Choice:
    index: int
    prompt: int  # which prompt of the request
    pending: PendingRequest
    echo: str = ""  # the prompt's text, put before the completion (completions' ``echo``)
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    last: TextDelta | None = None
    completion_logprobs: CompletionLogprobs | None = None

    def add(self, delta: TextDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.last = delta


def _params(ingress, req, prompt_len: int, chat: bool, s: dict) -> SamplingParams:
    context = ingress.max_context
    if prompt_len >= context:
        raise ApiError(
            f"{'messages' if chat else 'prompt'}: the prompt has {prompt_len} tokens; "
            f"the model's context is {context} tokens",
            param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = context - prompt_len
    elif prompt_len + max_tokens > context:
        raise ApiError(
            f"max_tokens: {max_tokens} + the prompt's {prompt_len} tokens exceed the model's context "
            f"of {context} tokens", param="max_tokens", code="context_length_exceeded")
    return SamplingParams(max_tokens=max_tokens, **s)


def _check(ingress, req, s: dict) -> None:
    if req.model is not None and req.model != ingress.served_name:
        raise ApiError(f"model: unknown model {req.model!r}; this server serves {ingress.served_name!r}",
                       param="model", code="model_not_found")
    if any(token >= ingress.vocab_size for token in s["logit_bias"]):
        raise ApiError(f"logit_bias: token ids must be in [0, {ingress.vocab_size})", param="logit_bias")
    if s["guide"] and (error := guide_error(s["guide"])) is not None:
        param = "response_format.json_schema.schema"
        raise ApiError(f"{param}: cannot be enforced: {error}", param=param)


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    if not j or params.seed is None:
        return params
    seed = params.seed + j
    return replace(params, seed=seed if seed <= SEED_MAX else params.seed - j)


async def serve(ingress, http: Request, req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
                chat: bool, echoes: list[str] | None = None):
    """Admit every choice of the request, then answer: a response, or a stream."""
    s = sampling_from(req)
    _check(ingress, req, s)
    stop, skip = req.stop, req.skip_special_tokens
    n = req.n or 1
    request_id = new_request_id(chat)
    params = [_params(ingress, req, len(p), chat, s) for p in prompts]  # every prompt checked before any runs
    choices: list[Choice] = []
    try:
        for p, prompt_ids in enumerate(prompts):
            route = None
            for j in range(n):
                index = p * n + j
                pending = await ingress.submit(request_id if index == 0 else f"{request_id}-{index}", prompt_ids,
                                               _seeded(params[p], j), stop, skip, kv_ttl_s=req.kv_ttl_s,
                                               route=route)
                route = pending.route
                choices.append(Choice(index, p, pending, echoes[p] if echoes else ""))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return ClosingStreamingResponse(_stream(ingress, request_id, choices, prompts, chat, include_usage),
                                            media_type="text/event-stream")
        return await _collect(ingress, http, request_id, choices, prompts, chat)
    except BaseException:  # whatever raised, no choice holds a slot after it (idempotent)
        for choice in choices:
            ingress.cancel_request(choice.pending, "failed")
        raise


async def _results(ingress, pending: PendingRequest):
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


def _usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
    """The prompts' tokens once each (``n`` choices share one), every choice's output."""
    firsts = [c for c in choices if c.index % (len(choices) // len(prompts)) == 0]
    drafts = (sum(c.pending.drafts[0] for c in choices), sum(c.pending.drafts[1] for c in choices))
    return usage(sum(len(p) for p in prompts), sum(c.last.completion_tokens for c in choices),
                 sum(c.pending.cached_tokens for c in firsts), drafts)


def _completion_parts(ingress, choice: Choice, prompt_ids: list[int], token_ids: list[int],
                      logprobs: list[TokenLogprob], with_prompt: bool) -> dict | None:
    """Completion logprobs of these tokens (with the echoed prompt's first, if ``with_prompt``)."""
    if choice.completion_logprobs is None:
        choice.completion_logprobs = CompletionLogprobs(ingress.token_texts)
    parts = []
    if with_prompt:
        parts.append(choice.completion_logprobs.part(prompt_ids, [None, *choice.prompt_logprobs]))
    parts.append(choice.completion_logprobs.part(token_ids, list(logprobs)))
    return joined(parts)


async def _collect(ingress, http: Request, request_id: str, choices: list[Choice], prompts: list[list[int]],
                   chat: bool):
    async def gather(choice: Choice) -> None:
        async for delta in _results(ingress, choice.pending):
            choice.add(delta)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(gather(c) for c in choices)))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            for choice in choices:
                ingress.cancel_request(choice.pending, "client disconnected")
            return JSONResponse({}, status_code=499)
        work.result()  # raises the first choice's ApiError (the caller cancels the rest)
    finally:
        watch.cancel()
    for choice in choices:
        ingress.finish(choice.pending, choice.last.timeline, choice.last.finish_reason)
    wanted = choices[0].pending.submission.sampling.logprobs is not None
    bodies = []
    for c in choices:
        text = c.echo + "".join(c.texts)
        if chat:
            lp = chat_logprobs(ingress.token_texts, c.token_ids, c.logprobs) if wanted else None
            bodies.append(chat_choice(c.index, text, c.last.finish_reason, lp))
        else:
            lp = _completion_parts(ingress, c, prompts[c.prompt], c.token_ids, c.logprobs,
                                   bool(c.echo)) if wanted else None
            bodies.append(completion_choice(c.index, text, c.last.finish_reason, lp))
    return JSONResponse(response(request_id, ingress.served_name, ingress.fingerprint, chat, bodies,
                                 _usage(choices, prompts)))


async def _stream(ingress, request_id: str, choices: list[Choice], prompts: list[list[int]], chat: bool,
                  include_usage: bool):
    model, created, fingerprint = ingress.served_name, int(time.time()), ingress.fingerprint
    wanted = choices[0].pending.submission.sampling.logprobs is not None
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in _results(ingress, choice.pending):
                arrived.put_nowait((choice, delta))
        except ApiError as exc:
            arrived.put_nowait((choice, exc))

    pumps = [asyncio.ensure_future(pump(c)) for c in choices]
    finished = 0
    try:
        for c in choices:
            if chat:
                yield sse(chat_chunk(request_id, model, created, fingerprint, c.index, "", None, role_first=True))
        while finished < len(choices):
            choice, item = await arrived.get()
            if isinstance(item, ApiError):
                yield sse(error_body(item))
                return
            echo = not chat and bool(choice.echo) and choice.last is None
            choice.add(item)
            text = (choice.echo if echo else "") + item.text
            if text or item.logprobs:
                if chat:
                    lp = chat_logprobs(ingress.token_texts, item.token_ids, item.logprobs) if wanted else None
                    yield sse(chat_chunk(request_id, model, created, fingerprint, choice.index, text, None,
                                         logprobs=lp))
                else:
                    lp = _completion_parts(ingress, choice, prompts[choice.prompt], item.token_ids, item.logprobs,
                                           echo) if wanted else None
                    yield sse(completion_chunk(request_id, model, created, fingerprint, choice.index, text, None, lp))
            if item.finish_reason is not None:
                finished += 1
                ingress.finish(choice.pending, item.timeline, item.finish_reason)
                yield sse(chat_chunk(request_id, model, created, fingerprint, choice.index, None, item.finish_reason)
                          if chat else completion_chunk(request_id, model, created, fingerprint, choice.index, "",
                                                        item.finish_reason))
        if include_usage:
            yield sse(usage_chunk(request_id, model, created, fingerprint, chat, _usage(choices, prompts)))
        yield sse("[DONE]")
    finally:
        for task in pumps:
            task.cancel()
        for c in choices:
            if c.last is None or c.last.finish_reason is None:
                ingress.cancel_request(c.pending, "client disconnected or failed")
