"""The OpenAI API's responses and stream chunks, as plain dicts in OpenAI's exact shape, with
``n`` choices (and, for completions, several prompts: choice ``p * n + j`` is prompt ``p``'s
``j``-th); :func:`sse` frames them for streaming.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from pdflow import __version__

_json_encode = msgspec.json.Encoder().encode


def system_fingerprint(weights: str) -> str:
    """What produced the output: pdflow's version and the weight format (as OpenAI's field, it
    changes when the backend does)."""
    return f"pdflow-{__version__}-{weights}"


def new_request_id(chat: bool) -> str:
    """``chatcmpl-<hex>`` or ``cmpl-<hex>``: the ``id`` every response of a request carries."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          drafts: tuple[int, int] = (0, 0)) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came
    from the prefix cache; with speculative decoding (``drafts``: draft tokens verified, kept),
    ``completion_tokens_details`` says how many were accepted and rejected, in the fields OpenAI
    uses for predicted outputs."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    proposed, accepted = drafts
    if proposed:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": proposed - accepted}
    return body


def _envelope(request_id: str, obj: str, model: str, created: int, fingerprint: str, choices: list) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def response(request_id: str, model: str, fingerprint: str, chat: bool, choices: list[dict], used: dict) -> dict:
    """The whole (non-streamed) response."""
    body = _envelope(request_id, "chat.completion" if chat else "text_completion", model, int(time.time()),
                     fingerprint, choices)
    body["usage"] = used
    return body


def chat_chunk(request_id: str, model: str, created: int, fingerprint: str, index: int, delta_text: str | None,
               finish_reason: str | None, role_first: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed chat chunk of choice ``index``; its first (``role_first``) announces the role."""
    if role_first:
        delta = {"role": "assistant", "content": delta_text or ""}
    else:
        delta = {} if delta_text is None else {"content": delta_text}
    return _envelope(request_id, "chat.completion.chunk", model, created, fingerprint,
                     [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])


def completion_chunk(request_id: str, model: str, created: int, fingerprint: str, index: int, text: str,
                     finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return _envelope(request_id, "text_completion", model, created, fingerprint,
                     [completion_choice(index, text, finish_reason, logprobs)])


def usage_chunk(request_id: str, model: str, created: int, fingerprint: str, chat: bool, used: dict) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    body = _envelope(request_id, "chat.completion.chunk" if chat else "text_completion", model, created,
                     fingerprint, [])
    body["usage"] = used
    return body


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``; a string (``"[DONE]"``) goes verbatim."""
    payload = data.encode() if isinstance(data, str) else _json_encode(data)
    return b"data: " + payload + b"\n\n"
