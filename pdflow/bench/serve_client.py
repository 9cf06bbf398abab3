"""One streamed request against an OpenAI-compatible server, timed on the client.

The clock starts when the request is sent; the first chunk that carries text is the first token
(TTFT), and every later text chunk closes one gap (TBT). Output tokens come from the server's
``usage`` (``stream_options.include_usage``), else from the count of text chunks; both are kept so
a report can say whether they agree.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass(slots=True)
class RequestRecord:
    index: int
    prompt_len: int  # tokens the benchmark asked for
    output_len: int  # max_tokens asked for
    scheduled_s: float = 0.0  # arrival time, from the start of the run
    sent_s: float = 0.0  # when it was sent (later than scheduled when --max-concurrency waits)
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    chunks: int = 0  # chunks that carried text
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server says
    drafts_accepted: int | None = None  # usage.completion_tokens_details: speculative draft tokens kept ...
    drafts_rejected: int | None = None  # ... and rejected, when the server says
    output_tokens: int = 0  # usage when the server sent it, else chunks
    finish_reason: str | None = None
    request_id: str | None = None
    error: str | None = None
    timeline: dict | None = None
    prompt: str | list[int] | None = None  # only with --save-prompts
    session: int | None = None  # multi-turn: which session, which turn
    turn: int | None = None
    text: str | None = None  # the answer, when the runner needs it (multi-turn)
    prompt_ids: list[int] | None = None  # for the cache bound; not written to the results
    answer_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        skip = {"prompt_ids", "answer_ids", "text"}
        return {k: v for k, v in asdict(self).items()
                if k not in skip and not (k in ("prompt", "session", "turn") and v is None)}


def payload(endpoint: str, model: str, prompt: str | list[int], max_tokens: int,
            ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM, SGLang and pdflow extension
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord,
               origin: float, keep_text: bool = False) -> None:
    """POST ``body`` to ``url`` and fill ``record`` (with the answer in ``record.text`` when
    ``keep_text``); any failure lands in ``record.error``."""
    chat = "messages" in body
    start = time.perf_counter()
    record.sent_s = start - origin
    last = None
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:500]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return
                now = time.perf_counter()
                record.request_id = record.request_id or chunk.get("id")
                if usage := chunk.get("usage"):
                    record.usage_prompt_tokens = usage.get("prompt_tokens")
                    record.usage_completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = details["cached_tokens"]
                    drafts = usage.get("completion_tokens_details") or {}
                    if drafts.get("accepted_prediction_tokens") is not None:
                        record.drafts_accepted = drafts["accepted_prediction_tokens"]
                        record.drafts_rejected = drafts.get("rejected_prediction_tokens") or 0
                for choice in chunk.get("choices") or []:
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                if text := _text(chunk, chat):
                    if keep_text:
                        parts.append(text)
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.gaps_s.append(now - last)
                    last = now
                    record.chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]
        return
    finally:
        record.e2e_s = time.perf_counter() - start
        if keep_text:
            record.text = "".join(parts)
    if record.ttft_s is None:
        record.error = "the stream ended without any text"
    record.output_tokens = (record.usage_completion_tokens if record.usage_completion_tokens is not None
                            else record.chunks)


async def fetch_timeline(client: httpx.AsyncClient, base_url: str, request_id: str) -> dict | None:
    """pdflow's ``/debug/timeline/{id}``; None from servers without it (404) or on any error."""
    try:
        response = await client.get(f"{base_url}/debug/timeline/{request_id}")
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None
