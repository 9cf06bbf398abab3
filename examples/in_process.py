"""A whole pipeline inside one Python process, driven by the official `openai` client.

    python examples/in_process.py

Every stage (ingress, prefill, kv-shuttle, decode, egress) runs as an asyncio task of this
process, the KV moves over the in-process transport, and the HTTP API is the same as `pdflow run`
serves: handy in a notebook or a test.
"""

from __future__ import annotations

import argparse
import asyncio

import openai

from pdflow.log import configure_logging
from pdflow import LocalPipeline, Pipeline


async def main(port: int, question: str) -> str:
    async with LocalPipeline(Pipeline.default().with_ports(port)) as running:
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        reply = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24,
        )
        return reply.choices[0].message.content


if __name__ == "__main__":
    configure_logging("console", "warning", stage="local")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=18000, help="the HTTP port (default: %(default)s)")
    parser.add_argument("--question", default="What is the capital of France?")
    args = parser.parse_args()
    print(asyncio.run(main(args.port, args.question)))
