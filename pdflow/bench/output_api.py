"""``pdflow bench output-api``: what logprobs and a JSON schema cost per output token.

One `pdflow run` of the default topology (or ``--topology``); the same chat requests, streamed,
sent plain, with ``logprobs`` and ``top_logprobs: 5``, and with a ``response_format`` JSON schema,
the three kinds interleaved round by round (the schema's story is at least 600 characters long,
so that guided answers run to ``max_tokens`` as the others do with ``ignore_eos``) (so that drift on the machine falls on all three
alike), ``--concurrency`` requests at a time. TPOT is a request's (last token - first token) /
(tokens - 1) from the stream's arrival times; printed: each kind's median TPOT and its ratio to
the plain requests' from the same run. Every reply goes through the official openai client's
parsing; every guided reply is checked against its schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdflow import client_key

DESCRIPTION = __doc__
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "story"],
          "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string", "minLength": 600}}}
KINDS = {
    "plain": {},
    "logprobs 5": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}},
}


async def _one(client, kind: str, i: int, max_tokens: int) -> tuple[float, int]:
    messages = [{"role": "user", "content": f"Write a long story about a fox, number {i}, as JSON with a title."}]
    extra = {} if kind == "json_schema" else {"ignore_eos": True}
    stamps, text = [], ""
    stream = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, extra_body=extra, **KINDS[kind])
    async for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].logprobs):
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content or ""
    if kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except ValueError:  # cut by max_tokens: a prefix of valid JSON (finish_reason length)
            pass
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan"), len(stamps)


async def _measure(url: str, rounds: int, concurrency: int, max_tokens: int,
                   api_key: str | None = None) -> dict[str, list[float]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
    tpots: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for kind in KINDS:  # warm-up: the grammar engine's first load, the first requests' allocations
        await _one(client, kind, -1, 8)
    for r in range(rounds):
        for kind in KINDS:
            results = await asyncio.gather(*(_one(client, kind, r * concurrency + j, max_tokens)
                                             for j in range(concurrency)))
            tpots[kind] += [tpot for tpot, tokens in results if tokens > 8]
    return tpots


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=6, help="rounds of each kind (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at a time (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=96, help="per request (default: %(default)s)")
    p.add_argument("--url", default=None, help="a running server instead of starting the default topology")
    client_key.add_argument(p)


def main(args: argparse.Namespace) -> int:
    from pdflow.testing.server import PdflowServer

    if args.url:
        tpots = asyncio.run(_measure(args.url, args.rounds, args.concurrency, args.max_tokens,
                                     client_key.api_key(args)))
    else:
        with PdflowServer(Path(tempfile.mkdtemp(prefix="pdflow-output-api-"))) as server:
            tpots = asyncio.run(_measure(server.url, args.rounds, args.concurrency, args.max_tokens))
    base = statistics.median(tpots["plain"])
    sys.stdout.write(f"TPOT, median over {args.rounds} rounds x {args.concurrency} concurrent requests "
                     f"(max_tokens {args.max_tokens}):\n")
    for kind, values in tpots.items():
        median = statistics.median(values)
        sys.stdout.write(f"  {kind:<12} {median * 1e3:7.2f} ms  x{median / base:.3f} of plain  ({len(values)} requests)\n")
    return 0
