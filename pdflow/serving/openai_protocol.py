"""The OpenAI HTTP API: request schemas with their validation, and response/stream builders.

Requests are pydantic models parsed straight from the body bytes; any problem becomes an
:class:`ApiError` (400) whose ``param`` names the offending field, in OpenAI's error format.
Fields we do not know are ignored (clients send extras); fields we know that would change the
completion but are not honoured (tools, beam search, vLLM's guided_* fields...) are refused with a
400 naming them unless their value changes nothing, never silently ignored.
Responses are built in :mod:`pdflow.serving.openai_responses`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pdflow.guides import guide_text

# bounds of the integer fields: what the wire (msgpack: int64/uint64) and the engine can carry
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_N = 8  # choices per request
MAX_PROMPTS = 64  # prompts per completion request
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024  # tokens biased per request
MAX_REPETITION_PENALTY = 100.0
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

# marks in the request models' JSON schemas that the served document fills in
# (:mod:`pdflow.serving.openapi`): the served model's name; a token id (below the vocabulary's size),
# as an integer or as the decimal text of a ``logit_bias`` key
SERVED_MODEL, VOCAB_ID, VOCAB_ID_TEXT = "x-pdflow-served-model", "x-pdflow-vocab-id", "x-pdflow-vocab-id-text"
_STOP = {"anyOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "maxLength": MAX_STOP_CHARS}},
                   {"type": "null"}]}


def exactly_one(names: tuple[str, ...]):
    """A model's JSON-schema extra and before-validator for a body that gives exactly one of the
    fields ``names`` (none of them null)."""
    def schema_extra(schema: dict[str, Any]) -> None:
        schema["oneOf"] = [{"required": [name], "not": {"anyOf": [{"required": [other]} for other in names
                                                                 if other != name]}} for name in names]
        for name in names:
            field = schema["properties"][name]
            if "anyOf" in field:
                field["anyOf"] = [option for option in field["anyOf"] if option != {"type": "null"}]

    def check(body: Any) -> Any:
        if isinstance(body, dict):
            given = [name for name in names if name in body]
            if len(given) != 1:
                raise ApiError(f"body: give exactly one of {', '.join(names)}; got "
                               f"{', '.join(given) if given else 'none'}", param=given[-1] if given else "body")
            if body[given[0]] is None:
                raise ApiError(f"{given[0]}: must not be null", param=given[0])
        return body

    return schema_extra, check


def _replace(schema: dict[str, Any], new: dict[str, Any]) -> None:
    """A field's schema stated by hand (what its validator accepts), its title and default kept."""
    kept = {key: schema[key] for key in ("title", "default", "description") if key in schema}
    schema.clear()
    schema.update(new, **kept)



class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class JsonSchema(BaseModel):
    """``response_format.json_schema``, as OpenAI's: the output validates against ``schema``."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}}, "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self

    def guide(self) -> str:
        """The guide the sampler follows (``""``: free text)."""
        if self.type == "json_object":
            return guide_text("json_object")
        if self.type == "json_schema":
            return guide_text("json_schema", self.json_schema.schema_)
        return ""


# fields a client may send that would change the completion and that pdflow does not do: each is
# refused with a 400 naming it unless its value is one of these, which change nothing
_NEUTRAL: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""), "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "logits_processors": (None, []), "allowed_token_ids": (None,),
    "bad_words": (None, []), "include_stop_str_in_output": (None, False), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (None, False), "audio": (None,),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "web_search_options": (None,),
    "spaces_between_special_tokens": (None, True),
}
_CHAT_NEUTRAL = {"add_generation_prompt": (None, True), "continue_final_message": (None, False),
                 "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None,),
                 "echo": (None, False)}


def _refuse_unhonoured(body: Any, neutral: dict[str, tuple]) -> None:
    if not isinstance(body, dict):
        return
    for name, values in neutral.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in values):
            raise ApiError(f"{name}: not supported by this server (it would change the completion); leave it out",
                           param=name)


class _Request(BaseModel):
    """Fields shared by both endpoints. Strict: ``"10"`` is not an integer, ``"true"`` not a bool."""

    model_config = ConfigDict(strict=True, extra="ignore")
    # fields refused unless their value is one of these (the API document states them too, so that a
    # client generating requests from it does not send one as an extra property the server refuses)
    neutral: ClassVar[dict[str, tuple]] = _NEUTRAL

    model: str | None = Field(default=None, json_schema_extra={SERVED_MODEL: True})
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # extension; 0 and -1 mean off
    min_p: float | None = Field(default=None, ge=0, le=1)  # extension, as vLLM's
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: tuple[str, ...] = Field(default=(), json_schema_extra=lambda schema: _replace(schema, _STOP))
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    kv_ttl_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # extension: keep my KV at most this long
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)  # extension, as vLLM's
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)  # extension, as vLLM's
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS, json_schema_extra=(
        lambda schema: _replace(schema, {"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                                     "propertyNames": {VOCAB_ID_TEXT: True},
                                                     "additionalProperties": {"type": "number", "minimum": -100,
                                                                              "maximum": 100}},
                                                    {"type": "null"}]})))
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _unhonoured(cls, body: Any) -> Any:
        _refuse_unhonoured(body, cls.neutral)
        return body

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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit() or key != str(int(key)) or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids (non-negative integers as strings, no leading zeros), "
                                 f"got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: a bias must be within [-100, 100], got {bias}")
        return v

    def logprobs_wanted(self) -> int | None:
        """How many alternatives each output token's logprobs come with (None: no logprobs)."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        return None


_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}


def _message_schema(schema: dict[str, Any]) -> None:
    """The document's ChatMessage: what the validator below accepts (content may be null only
    for the assistant)."""
    def message(roles: list[str], nullable: bool) -> dict:
        content = [{"type": "string"}, _TEXT_PARTS, *([{"type": "null"}] if nullable else [])]
        return {"type": "object", "required": ["role", "content"],
                "properties": {"role": {"type": "string", "enum": roles}, "content": {"anyOf": content}}}

    schema.clear()
    schema.update({"title": "ChatMessage", "oneOf": [message(["system", "user"], False), message(["assistant"], True)]})


def template_messages(messages: "list[ChatMessage]") -> list[dict[str, str]]:
    """Messages as ``apply_chat_template`` expects them (content always a string)."""
    return [{"role": m.role, "content": m.content or ""} for m in messages]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_message_schema)

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
        return v


def _chat_schema(schema: dict[str, Any]) -> None:
    # top_logprobs above 0 needs logprobs true
    schema["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}}
    schema["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}


class ChatCompletionRequest(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_chat_schema)

    neutral: ClassVar[dict[str, tuple]] = {**_NEUTRAL, **_CHAT_NEUTRAL}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def model_post_init(self, _context: Any) -> None:
        if self.max_completion_tokens is not None:  # the newer name wins, as in vLLM
            self.max_tokens = self.max_completion_tokens

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ApiError("top_logprobs: needs logprobs set to true", param="top_logprobs")
        return self

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as ``apply_chat_template`` expects them (content always a string)."""
        return template_messages(self.messages)


Prompt = str | list[int]


_ONE_PROMPT = [{"type": "string", "minLength": 1},
               {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, VOCAB_ID: True}}]
ONE_PROMPT = {"anyOf": _ONE_PROMPT}  # (the schema of one prompt)
_PROMPT = {"anyOf": [*_ONE_PROMPT, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                    "items": {"anyOf": _ONE_PROMPT}}]}


class CompletionRequest(_Request):
    # one prompt (text or token ids) or several
    prompt: str | list[int] | list[str | list[int]] = Field(json_schema_extra=lambda schema: _replace(schema, _PROMPT))
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Prompt | list[Prompt]:
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):  # several prompts
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            prompts = [cls._one_prompt(p, f"prompt {i}: ") for i, p in enumerate(v)]
            return prompts[0] if len(prompts) == 1 else prompts
        return cls._one_prompt(v, "")

    @staticmethod
    def _one_prompt(v: Any, where: str) -> Prompt:
        if isinstance(v, str):
            if not v:
                raise ValueError(f"{where}must not be empty")
            return v
        if not isinstance(v, list):
            raise ValueError(f"{where}must be a string or a list of token ids")
        if not v:
            raise ValueError(f"{where}must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in v):
            raise ValueError(f"{where}a list prompt must hold non-negative token ids")
        return v

    def prompts(self) -> list[Prompt]:
        """Each prompt of the request (one, or the batch it sent)."""
        p = self.prompt
        return p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None


def _json_number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """A body parsed and validated as ``model``; any problem an :class:`ApiError` (400) naming the
    field. A number with no fraction (``3.0``) is an integer, as JSON Schema counts it."""
    try:
        data = json.loads(body, parse_float=_json_number)
    except (ValueError, RecursionError) as e:
        raise ApiError(f"invalid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "model_type":
            msg = "the request body must be a JSON object"
        elif err["type"] == "too_short" and param == "messages":
            msg = "must contain at least one message"
        raise ApiError(f"{param}: {msg}" if param else msg, param=param) from None


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a ``/v1/chat/completions`` body; raises :class:`ApiError` (400)."""
    return parse_body(ChatCompletionRequest, body)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse and validate a ``/v1/completions`` body; raises :class:`ApiError` (400)."""
    return parse_body(CompletionRequest, body)


def sampling_from(req: _Request) -> dict:
    """The request's sampling settings, defaults filled in (``top_k`` 0 means off): the
    :class:`~pdflow.messages.SamplingParams` fields but ``max_tokens``, which needs the prompt's length."""
    return {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": max(req.top_k or 0, 0),
        "seed": req.seed,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "min_p": req.min_p or 0.0,
        "min_tokens": req.min_tokens or 0,
        "logit_bias": {int(k): float(v) for k, v in (req.logit_bias or {}).items() if v},
        "logprobs": req.logprobs_wanted(),
        "prompt_logprobs": req.prompt_logprobs_wanted(),
        "guide": req.response_format.guide() if req.response_format is not None else "",
    }
