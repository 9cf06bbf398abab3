"""The OpenAI HTTP API: request schemas with their validation, and response/stream builders.

Requests are pydantic models parsed straight from the body bytes; any problem becomes an
:class:`ApiError` (400) whose ``param`` names the offending field, in OpenAI's error format.
Fields we do not know are ignored (clients send extras); fields we know but cannot honour
(``n > 1``, ``logprobs``, penalties) are refused rather than silently ignored.
Responses are plain dicts in OpenAI's exact shape; :func:`sse` frames them for streaming.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

_json_encode = msgspec.json.Encoder().encode

# bounds of the integer fields: what the wire (msgpack: int64/uint64) and the engine can carry
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 256
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class ApiError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


# --- requests ------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints. Strict: ``"10"`` is not an integer, ``"true"`` not a bool."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # extension; 0 and -1 mean off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: tuple[str, ...] = ()
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    kv_ttl_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # extension: keep my KV at most this long
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return tuple(s for s in v if s)  # an empty stop string would stop before the first token

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("not supported (only 0 is accepted)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("not supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | None  # text parts are joined into one string

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> str | None:
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"part {i}: only parts of type 'text' are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: 'text' must be a string")
                texts.append(part["text"])
            v = "\n".join(texts)  # as vLLM joins text parts
        elif v is not None and not isinstance(v, str):
            raise ValueError("must be a string or a list of text parts")
        role = info.data.get("role")
        if v is None and role != "assistant":
            raise ValueError(f"must not be null for role '{role}'")
        if not v and role == "user":
            raise ValueError("must not be empty")
        return v


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def model_post_init(self, _context: Any) -> None:
        if self.max_completion_tokens is not None:  # the newer name wins, as in vLLM
            self.max_tokens = self.max_completion_tokens

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _logprobs(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as ``apply_chat_template`` expects them (content always a string)."""
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of token ids")
        if not v:
            raise ValueError("must not be empty")
        if all(isinstance(t, str) for t in v) or all(isinstance(t, list) for t in v):
            raise ValueError("only one prompt per request is supported")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in v):
            raise ValueError("a list prompt must hold non-negative token ids")
        return v

    @field_validator("logprobs", "echo", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


def _parse(model: type[_Request], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(f"invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}") from None
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "model_type":
            msg = "the request body must be a JSON object"
        elif err["type"] == "too_short" and param == "messages":
            msg = "must contain at least one message"
        raise ApiError(f"{param}: {msg}" if param else msg, param=param) from None


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a ``/v1/chat/completions`` body; raises :class:`ApiError` (400)."""
    return _parse(ChatCompletionRequest, body)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse and validate a ``/v1/completions`` body; raises :class:`ApiError` (400)."""
    return _parse(CompletionRequest, body)


def sampling_from(req: _Request) -> dict:
    """The request's sampling settings, defaults filled in (``top_k`` 0 means off)."""
    return {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": max(req.top_k or 0, 0),
        "seed": req.seed,
        "max_tokens": req.max_tokens,
        "stop": req.stop,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "kv_ttl_s": req.kv_ttl_s,
    }


# --- responses -----------------------------------------------------------------------------


def new_request_id(chat: bool) -> str:
    """``chatcmpl-<hex>`` or ``cmpl-<hex>``: the ``id`` every response of a request carries."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafts: tuple[int, int] = (0, 0)) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came
    from the prefix cache; with speculative decoding (``drafts``: draft tokens verified, kept),
    ``completion_tokens_details`` says how many were accepted and rejected, in the fields OpenAI
    uses for predicted outputs."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    proposed, accepted = drafts
    if proposed:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": proposed - accepted}
    return usage


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                  drafts: tuple[int, int] = (0, 0)) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens, drafts),
    }


def chat_chunk(request_id: str, model: str, created: int, delta_text: str | None,
               finish_reason: str | None, role_first: bool = False) -> dict:
    """One streamed chat chunk; the first (``role_first``) announces the assistant role."""
    if role_first:
        delta = {"role": "assistant", "content": delta_text or ""}
    else:
        delta = {} if delta_text is None else {"content": delta_text}
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None,
                        prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                        drafts: tuple[int, int] = (0, 0)) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens, drafts),
    }


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int, chat: bool, cached_tokens: int = 0, drafts: tuple[int, int] = (0, 0)) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": [],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens, drafts),
    }


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``; a string (``"[DONE]"``) goes verbatim."""
    payload = data.encode() if isinstance(data, str) else _json_encode(data)
    return b"data: " + payload + b"\n\n"
