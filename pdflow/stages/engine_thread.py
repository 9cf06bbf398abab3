"""The one thread a stage runs its model in, from loading to the last step.

PyTorch's OpenMP (libgomp) keeps a pool of worker threads for each thread that calls into it.
A stage that loaded its model in one thread (``asyncio.to_thread``) and stepped it in another
had two pools: libgomp then counts more threads than cores, stops spinning at its barriers and
sleeps on a futex instead, and each of a decode step's ~150 parallel regions pays for the
wake-ups (measured: 23 ms a SmolLM2 decode step in the worker stage against 13 ms bare). One
thread for all of the model's work keeps one pool.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


def engine_thread(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix=name)


async def run_in(executor: ThreadPoolExecutor, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
