"""Send a workload on its arrival schedule (or run its chat sessions) and collect one record per request."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from pdflow import client_key
from pdflow.bench.prompts import PromptBuilder
from pdflow.bench.serve_client import RequestRecord, fetch_timeline, payload, send
from pdflow.bench.workloads import BenchRequest, SessionPlan


@dataclass(slots=True)
class Target:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    ignore_eos: bool = True
    text_prompts: bool = False  # send text to /v1/completions too, not token ids
    timeout_s: float = 600.0
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"


def schedule(requests: list[BenchRequest], rate: float | None, seed: int) -> list[float]:
    """Arrival times (s from the start): the trace's own when ``rate`` is None, all at once for
    ``inf``, else a seeded Poisson process of ``rate`` requests per second."""
    if rate is None:
        return [r.arrival_s or 0.0 for r in requests]
    if rate == float("inf"):
        return [0.0] * len(requests)
    rng, t, times = random.Random(seed), 0.0, []
    for _ in requests:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def client_for(target: Target, connections: int) -> httpx.AsyncClient:
    headers = client_key.headers(target.api_key)
    limits = httpx.Limits(max_connections=max(connections, 1), max_keepalive_connections=max(connections, 1))
    timeout = httpx.Timeout(target.timeout_s, connect=min(30.0, target.timeout_s))
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout)


async def run(target: Target, requests: list[BenchRequest], builder: PromptBuilder, arrivals: list[float],
              max_concurrency: int | None = None, timelines: bool = False, save_prompts: bool = False,
              progress: bool = True, label: str = "") -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (waiting for a free slot under ``max_concurrency``);
    returns the records, in workload order, and the seconds from the start to the last reply."""
    bodies, records = [], []
    for i, req in enumerate(requests):
        prompt = req.prompt
        if isinstance(prompt, list) and (target.endpoint == "chat" or target.text_prompts):
            prompt = builder.text(prompt)
        bodies.append(payload(target.endpoint, target.model, prompt, req.output_len, target.ignore_eos))
        records.append(RequestRecord(i, req.prompt_len, req.output_len, scheduled_s=arrivals[i],
                                     prompt=prompt if save_prompts else None,
                                     prompt_ids=req.prompt if isinstance(req.prompt, list) else None))
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=label or "requests", unit="req", disable=not progress,
               dynamic_ncols=True)
    finished = 0.0

    async with client_for(target, max_concurrency or len(requests)) as client:
        async def one(i: int) -> None:
            nonlocal finished
            if slots:
                await slots.acquire()
            try:
                await send(client, target.url, bodies[i], records[i], origin)
            finally:
                if slots:
                    slots.release()
            finished = max(finished, time.perf_counter() - origin)
            if timelines and records[i].request_id:
                records[i].timeline = await fetch_timeline(client, target.base_url, records[i].request_id)
            bar.update(1)

        tasks = []
        origin = time.perf_counter()
        for i in sorted(range(len(requests)), key=lambda k: arrivals[k]):
            delay = arrivals[i] - (time.perf_counter() - origin)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    bar.close()
    return records, finished


async def run_sessions(target: Target, sessions: list[SessionPlan], builder: PromptBuilder, starts: list[float],
                       think_time_s: float, max_concurrency: int | None = None, progress: bool = True,
                       label: str = "") -> tuple[list[RequestRecord], float]:
    """Run each multi-turn session from its start time: every turn sends the history so far (each
    earlier prompt and the model's answer as the client received it, tokenized again) plus the
    turn's new message, ``think_time_s`` after the previous answer ended. Returns the records (in
    the order they were sent) and the seconds from the start to the last reply."""
    records: list[RequestRecord] = []
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    total = sum(s.turns for s in sessions)
    bar = tqdm(total=total, desc=label or "turns", unit="req", disable=not progress, dynamic_ncols=True)
    finished = 0.0

    async with client_for(target, max_concurrency or len(sessions)) as client:
        async def session(plan: SessionPlan, start: float) -> None:
            nonlocal finished
            await asyncio.sleep(max(0.0, start - (time.perf_counter() - origin)))
            prompt_ids = plan.first
            for turn in range(plan.turns):
                prompt = builder.text(prompt_ids) if target.endpoint == "chat" or target.text_prompts else prompt_ids
                record = RequestRecord(len(records), len(prompt_ids), plan.output_len,
                                       scheduled_s=time.perf_counter() - origin, session=plan.index, turn=turn,
                                       prompt_ids=prompt_ids)
                records.append(record)
                body = payload(target.endpoint, target.model, prompt, plan.output_len, target.ignore_eos)
                if slots:
                    await slots.acquire()
                try:
                    await send(client, target.url, body, record, origin, keep_text=True)
                finally:
                    if slots:
                        slots.release()
                finished = max(finished, time.perf_counter() - origin)
                bar.update(1)
                if not record.ok:
                    bar.update(plan.turns - turn - 1)
                    return
                record.answer_ids = builder.tokenizer.encode(record.text or "")
                if turn + 1 < plan.turns:
                    prompt_ids = prompt_ids + record.answer_ids + plan.messages[turn]
                    await asyncio.sleep(think_time_s)

        origin = time.perf_counter()
        await asyncio.gather(*(session(plan, start) for plan, start in zip(sessions, starts)))
    bar.close()
    return records, finished
