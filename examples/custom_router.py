"""A custom router: requests that start with the same tokens go to the same replica.

    python examples/custom_router.py

Multi-turn chats and RAG prompts resend the same beginning; sending them to the replica that saw
it before is what a cache-aware router builds on. This one hashes the first `prefix_tokens`
prompt tokens to pick among the healthy replicas, and falls back to the least loaded one for
prompts shorter than that. It runs here with two decode replicas, in one process.

A package makes its router selectable by name through an entry point:

    [project.entry-points."pdflow.routers"]
    prefix_affinity = "mypkg.routers:PrefixAffinityRouter"

and a topology file then says `[router] policy = "prefix_affinity"`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from collections import Counter

import openai

from pdflow.log import configure_logging
from pdflow import LocalPipeline, Pipeline, ReplicaStatus, Router, RoutingRequest


class PrefixAffinityRouter(Router):
    def __init__(self, prefix_tokens: int = 16) -> None:
        self.prefix_tokens = prefix_tokens
        self.picks: Counter[tuple[str, int]] = Counter()

    def pick(self, stage: str, request: RoutingRequest, replicas: list[ReplicaStatus]) -> int:
        if len(request.prompt_ids) < self.prefix_tokens:
            choice = min(replicas, key=lambda r: (r.load, r.replica)).replica
        else:
            prefix = repr(request.prompt_ids[: self.prefix_tokens]).encode()
            choice = replicas[int.from_bytes(hashlib.blake2b(prefix, digest_size=8).digest()) % len(replicas)].replica
        self.picks[(stage, choice)] += 1
        return choice


def build(port: int) -> Pipeline:
    pipeline = Pipeline.default().with_stage_config("decode", replicas=2)
    return pipeline.with_router(PrefixAffinityRouter, prefix_tokens=16).with_ports(port)


async def main(port: int) -> Counter:
    async with LocalPipeline(build(port)) as running:
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        for question in ["Name a primary color.", "Name a primary color.", "Name a prime number."]:
            reply = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=8,
            )
            print(f"{question!r} -> {reply.choices[0].message.content!r}")
        return running.stage("ingress").router.picks


if __name__ == "__main__":
    configure_logging("console", "warning", stage="local")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=18100, help="the HTTP port (default: %(default)s)")
    picks = asyncio.run(main(parser.parse_args().port))
    print("replicas picked:", dict(sorted(picks.items())))
