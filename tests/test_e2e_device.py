"""End to end on a GPU: prefill and decode on ``cuda``, KV staged through pinned host buffers to and
from kv-shuttle's host store over tcp; greedy answers equal the engine's own on the CPU, fp32.

Runs only where CUDA is (scripts/device_check.sh on the device machine); skipped here.
"""

from __future__ import annotations

import pytest
import torch

from pdflow.testing.local_http import openai_client
from pdflow.testing.reference import chat_ids, greedy_answer
from pdflow.testing.server import PdflowServer, topology_text

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device_check.sh)")]

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Count from one to ten in words.",
             "What is 12 times 12?"]
MAX_TOKENS = 32


def _on_cuda(base: int) -> str:
    text = topology_text(base).replace('source = "smollm2"', 'source = "smollm2"\nweights = "fp32"', 1)
    return text.replace("cores = [0]\n", 'cores = [0]\ndevice = "cuda"\n', 1).replace(
        "cores = [1]\n", 'cores = [1]\ndevice = "cuda"\n', 1)


def test_greedy_answers_on_cuda_equal_the_cpu_engines(tmp_path, loaded_model):
    loaded, tokenizer = loaded_model  # fp32 weights, on the CPU
    with PdflowServer(tmp_path, topology=_on_cuda) as server:
        client = openai_client(server.url, timeout=120)
        for question in QUESTIONS:
            reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=MAX_TOKENS,
                                                   messages=[{"role": "user", "content": question}])
            expected = greedy_answer(loaded, tokenizer, chat_ids(tokenizer, question), MAX_TOKENS)
            assert reply.choices[0].message.content == expected, question
        stats = server.quiet_stats()
    prefill = next(v for k, v in stats.items() if k.startswith("prefill"))
    assert prefill["staged_bytes"] > 0  # the KV left device memory through the staging pool
