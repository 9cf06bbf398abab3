#!/usr/bin/env python
"""What the metrics cost the decode it measures: TPOT at batch 8 with ``GET /metrics`` scraped
every second against no scraping, rounds alternating on one server; and what ingress spends
recording a stream's tokens (vLLM's names and pdflow's), per token, against that TPOT. The scraper
fetches the page and leaves it (Prometheus parses on its own machine; here, on the same two
cores, its parse would be charged to pdflow); ``--parse`` parses it too.

    .venv/bin/python experiments/experiment_metrics_cost.py --rounds 12
"""

from __future__ import annotations

import asyncio
import statistics
import time
import types

import httpx
import openai

from pdflow.bench.experiments import Report, experiment_parser, serving

PROMPT = [1] + list(range(2000, 2064))  # 65 token ids: the same prompt for every stream


async def _stream(client: openai.AsyncOpenAI, tokens: int) -> float:
    """One streamed completion of ``tokens`` tokens; its TPOT (first token to last, per token)."""
    stamps = []
    stream = await client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.monotonic())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def _scrape_every_second(url: str, stop: asyncio.Event, scrapes: list[float], parse: bool) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            began = time.monotonic()
            text = (await http.get(f"{url}/metrics")).text
            if parse:
                sum(len(family.samples) for family in text_string_to_metric_families(text))
            scrapes.append(time.monotonic() - began)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


async def one_round(url: str, batch: int, tokens: int, scrape: bool, parse: bool = False
                    ) -> tuple[list[float], list[float]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    stop, scrapes = asyncio.Event(), []
    scraper = asyncio.ensure_future(_scrape_every_second(url, stop, scrapes, parse)) if scrape else None
    try:
        tpots = await asyncio.gather(*(_stream(client, tokens) for _ in range(batch)))
    finally:
        stop.set()
        if scraper is not None:
            await scraper
        await client.close()
    return list(tpots), scrapes


def recording_cost_us(tokens: int = 20_000) -> float:
    """Microseconds ingress spends recording one streamed token (ServingMetrics.tokens_arrived)."""
    from pdflow import Pipeline
    from pdflow.messages import Route
    from pdflow.serving.metrics import ServingMetrics
    from pdflow.stages.ingress import PendingRequest

    ingress = types.SimpleNamespace(pipeline=Pipeline.default(), requests={}, stage_status={})
    metrics = ServingMetrics(ingress)
    pending = PendingRequest("r", Route(), prompt_len=64, received=0.0)
    began = time.perf_counter()
    for n in range(1, tokens + 1):
        metrics.tokens_arrived(pending, n, now=n * 0.01)
    return (time.perf_counter() - began) / tokens * 1e6


def main() -> int:
    parser = experiment_parser(__doc__, "bench-results/metrics-cost")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of each (alternating; default 12)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent streams (default 8)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (default 128)")
    parser.add_argument("--parse", action="store_true", help="the scraper parses each page too")
    opts = parser.parse_args()
    report = Report()
    opts.out.mkdir(parents=True, exist_ok=True)
    report.header("What the metrics cost")
    tpot: dict[bool, list[float]] = {False: [], True: []}
    scrape_s: list[float] = []
    with serving() as server:
        asyncio.run(one_round(server.url, opts.batch, 16, False))  # warm
        for i in range(opts.rounds):
            for scrape in (False, True) if i % 2 == 0 else (True, False):
                tpots, scrapes = asyncio.run(one_round(server.url, opts.batch, opts.tokens, scrape, opts.parse))
                tpot[scrape].append(statistics.median(tpots))
                scrape_s += scrapes
                print(f"round {i}: scraping {'on ' if scrape else 'off'} median TPOT "
                      f"{tpot[scrape][-1] * 1e3:.2f} ms", flush=True)
    off, on = statistics.median(tpot[False]), statistics.median(tpot[True])
    record = recording_cost_us()
    report.say()
    report.say(f"Batch {opts.batch}, {opts.tokens} tokens a stream, {opts.rounds} rounds of each, alternating.")
    report.say()
    report.say("| | median TPOT | ratio |")
    report.say("|---|---:|---:|")
    report.say(f"| /metrics not scraped | {off * 1e3:.2f} ms | 1.000 |")
    report.say(f"| /metrics scraped every second | {on * 1e3:.2f} ms | {on / off:.3f} |")
    report.say()
    report.say(f"A scrape ({'fetched and parsed' if opts.parse else 'fetched'}): median {statistics.median(scrape_s) * 1e3:.1f} ms over "
               f"{len(scrape_s)} scrapes. Recording a streamed token in ingress (both vocabularies): "
               f"{record:.1f} µs, {record / (off * 1e6):.2%} of the TPOT.")
    report.write(opts.out / "summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
