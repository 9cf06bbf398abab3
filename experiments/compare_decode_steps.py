"""Decode's step time as requests see it, on servers of different data planes, alternating.

    .venv/bin/python experiments/compare_decode_steps.py --transports tcp shm --rounds 2

For each round and transport it starts the default topology with that transport on every link
(over shm, decode attends from the KV store's own blocks: zero copies), holds a short chat of
``--turns`` turns (a ~1,300-token first message; each turn resends the history with the model's
answers, 64 tokens each, ``ignore_eos``), and prints the mean time between decode steps of each
answer, from the request's timeline (``/debug/timeline``: ``decode.steps``).
"""

from __future__ import annotations

import httpx

from pdflow.bench.experiments import experiment_parser, serving


def _turns(url: str, turns: int, words: int) -> tuple[list[float], int]:
    messages = [{"role": "user", "content": "Summarize: " + " ".join(f"word{i}" for i in range(words))}]
    per_step, prompt = [], 0
    for _ in range(turns):
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                           json={"model": "smollm2", "messages": messages, "max_tokens": 64, "temperature": 0,
                                 "ignore_eos": True}).json()
        steps = httpx.get(f"{url}/debug/timeline/{reply['id']}", timeout=30).json()["decode.steps"]
        per_step.append((steps[-1] - steps[0]) / (len(steps) - 1) * 1e3)
        prompt = reply["usage"]["prompt_tokens"]
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "More " * 30}]
    return per_step, prompt


def main() -> int:
    parser = experiment_parser(__doc__)
    parser.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--words", type=int, default=300, help="of the first message (~4.4 tokens each)")
    opts = parser.parse_args()
    for _ in range(opts.rounds):
        for transport in opts.transports:
            with serving(transport=transport) as server:
                per_step, prompt = _turns(server.url, opts.turns, opts.words)
            print(f"{transport}: ms per decode step, by turn: {[round(t, 2) for t in per_step]} "
                  f"(last prompt {prompt} tokens)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
