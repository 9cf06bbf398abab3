"""Workloads: which requests a benchmark sends, with what prompt, output length and arrival time.

* ``fixed``: every request ``input_len`` prompt tokens and ``output_len`` output tokens.
* ``random``: lengths drawn uniformly from inclusive ranges, seeded.
* ``trace``: a Mooncake-format JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` over 512-token blocks). ``token_scale`` shrinks lengths and the block size
  together, so requests that share leading hash ids still share leading blocks; ``time_scale``
  speeds the arrivals up (2 = twice as fast). ``sample_conversations`` keeps every request of
  that many conversations picked at random (seeded), a conversation being the requests that
  share their first two hash ids (in Mooncake's conversation trace every request starts with the
  same block; the second tells conversations apart): a small replay that keeps the trace's
  reuse between turns, which its consecutive requests, minutes apart, hardly show. The traces
  themselves are Mooncake's, not shipped: :mod:`pdflow.bench.traces` says where to get them.
* ``jsonl``: a file of ``{"prompt": str | [ids], "max_tokens": n}`` lines, sent as written.
* ``rag``: ``documents`` documents of ``doc_len`` tokens, each asked ``questions`` questions of
  ``question_len`` tokens (prompt = document + question), in a seeded random order.
* ``multiturn``: ``sessions`` chats of ``turns`` turns. The first turn sends ``input_len`` tokens;
  every later turn sends the whole history (each earlier prompt, the model's actual answer,
  tokenized as the client saw it) plus a new message of ``turn_len`` tokens, ``think_time`` seconds
  after the answer came (see :func:`build_sessions`; the runner builds the prompts as answers come).

Generated prompts never share blocks unless a trace, a document or a chat history says so:
``fixed`` and ``random`` give each request its own key.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from pdflow.bench import traces
from pdflow.bench.prompts import PromptBuilder

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
DATASETS = ("fixed", "random", "trace", "jsonl", "rag", "multiturn")


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]  # token ids for generated prompts, else the text as given
    prompt_len: int  # tokens, by the benchmark's tokenizer
    output_len: int
    arrival_s: float | None = None  # from the trace; None: the arrival process decides
    hash_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WorkloadSpec:
    dataset: str = "fixed"
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 32
    input_len_range: tuple[int, int] | None = None
    output_len_range: tuple[int, int] | None = None
    path: str | None = None
    token_scale: float = 1.0
    time_scale: float = 1.0
    limit: int | None = None
    seed: int = 0
    documents: int = 4  # rag
    doc_len: int = 3000
    questions: int = 4
    question_len: int = 32
    sessions: int = 8  # multiturn
    turns: int = 4
    turn_len: int = 64
    think_time_s: float = 1.0
    sample_conversations: int | None = None  # trace

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: unknown {self.dataset!r} ({', '.join(DATASETS)})")
        for name in ("documents", "doc_len", "questions", "question_len", "sessions", "turns", "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.think_time_s < 0:
            raise ValueError(f"think_time must be >= 0, got {self.think_time_s}")
        if self.dataset in ("trace", "jsonl") and not self.path:
            raise ValueError(f"dataset {self.dataset}: --dataset-path is required")
        if self.token_scale <= 0 or self.time_scale <= 0:
            raise ValueError("token_scale and time_scale must be positive")
        for name in ("input_len_range", "output_len_range"):
            span = getattr(self, name)
            if span is not None and not 1 <= span[0] <= span[1]:
                raise ValueError(f"{name}: need 1 <= a <= b, got {span[0]}:{span[1]}")


def parse_range(text: str) -> tuple[int, int]:
    """``"a:b"`` as an inclusive pair of ints."""
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(f"expected a:b, got {text!r}")
    return int(lo), int(hi)


@dataclass(slots=True)
class SessionPlan:
    """One chat of a ``multiturn`` workload: its first prompt and each later turn's new message."""

    index: int
    first: list[int]
    messages: list[list[int]]
    output_len: int

    @property
    def turns(self) -> int:
        return 1 + len(self.messages)


def build(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    """The requests of a workload (for ``multiturn``: each session's first turn; see
    :func:`build_sessions` for the rest)."""
    if spec.dataset == "trace":
        return _trace(spec, builder)
    if spec.dataset == "jsonl":
        return _jsonl(spec, builder)
    if spec.dataset == "rag":
        return _rag(spec, builder)
    if spec.dataset == "multiturn":
        return [BenchRequest(s.first, len(s.first), s.output_len) for s in build_sessions(spec, builder)]
    rng = random.Random(spec.seed)
    requests = []
    for i in range(spec.num_prompts):
        if spec.dataset == "random":
            n_in = rng.randint(*(spec.input_len_range or (spec.input_len, spec.input_len)))
            n_out = rng.randint(*(spec.output_len_range or (spec.output_len, spec.output_len)))
        else:
            n_in, n_out = spec.input_len, spec.output_len
        ids = builder.prompt([f"r{i}"], [n_in])
        requests.append(BenchRequest(ids, len(ids), n_out))
    return requests


def scaled(tokens: int, scale: float) -> int:
    return max(1, round(tokens * scale))


def trace_prompt(builder: PromptBuilder, hash_ids: list[int], input_len: int, block: int) -> list[int]:
    """``input_len`` tokens as blocks of ``block`` tokens keyed by ``hash_ids``; the last block is
    the (partial) rest. A hash id always names the same tokens, whatever request it is in."""
    if not hash_ids:
        return builder.prompt(["h-none"], [input_len])
    n = len(hash_ids)
    last = min(max(input_len - (n - 1) * block, 1), block)
    return builder.prompt([f"h{h}" for h in hash_ids], [block] * (n - 1) + [last])


def _lines(path: str, limit: int | None) -> list[dict]:
    rows = []
    with open(Path(path).expanduser()) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    return rows


def trace_rows(spec: WorkloadSpec) -> list[dict]:
    """The trace's rows a ``trace`` workload replays, in arrival order (FileNotFoundError saying where
    to get one when ``spec.path`` is missing)."""
    rows = _lines(str(traces.existing(spec.path)), None if spec.sample_conversations else spec.limit)
    if spec.sample_conversations:
        keys = sorted({tuple(row.get("hash_ids", [])[:2]) for row in rows})
        picked = set(random.Random(spec.seed).sample(keys, min(spec.sample_conversations, len(keys))))
        rows = [row for row in rows if tuple(row.get("hash_ids", [])[:2]) in picked][: spec.limit]
    return sorted(rows, key=lambda r: r["timestamp"])  # stable: ties keep file order


def reusable_fraction(rows: list[dict]) -> float:
    """Of all the rows' hash blocks, the fraction whose whole prefix an earlier row sent."""
    seen: set[tuple[int, ...]] = set()
    reusable = total = 0
    for row in rows:
        ids = row.get("hash_ids", [])
        total += len(ids)
        reusable += next((k for k in range(len(ids)) if tuple(ids[: k + 1]) not in seen), len(ids))
        seen.update(tuple(ids[: k + 1]) for k in range(len(ids)))
    return reusable / total if total else 0.0


def _trace(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    block = scaled(TRACE_BLOCK, spec.token_scale)
    rows = trace_rows(spec)
    start = min((row["timestamp"] for row in rows), default=0)
    requests = []
    for row in rows:
        hash_ids = list(row.get("hash_ids", []))
        ids = trace_prompt(builder, hash_ids, scaled(row["input_length"], spec.token_scale), block)
        arrival = (row["timestamp"] - start) / 1000 / spec.time_scale
        requests.append(BenchRequest(ids, len(ids), scaled(row["output_length"], spec.token_scale),
                                     arrival, hash_ids))
    return requests


def _jsonl(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    requests = []
    for row in _lines(spec.path, spec.limit):
        prompt = row["prompt"]
        n_in = len(prompt) if isinstance(prompt, list) else len(builder.tokenizer.encode(prompt))
        requests.append(BenchRequest(prompt, n_in, int(row.get("max_tokens") or spec.output_len)))
    return requests


def shared_prefix_blocks(a: BenchRequest, b: BenchRequest) -> int:
    """How many leading hash ids two trace requests share."""
    return next((i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)) if x != y),
                min(len(a.hash_ids), len(b.hash_ids)))


def block_size(token_scale: float) -> int:
    return scaled(TRACE_BLOCK, token_scale)


def _rag(spec: WorkloadSpec, builder: PromptBuilder) -> list[BenchRequest]:
    pairs = [(d, q) for d in range(spec.documents) for q in range(spec.questions)]
    random.Random(spec.seed).shuffle(pairs)
    requests = []
    for d, q in pairs:
        ids = builder.prompt([f"doc{d}", f"doc{d}.q{q}"], [spec.doc_len, spec.question_len])
        requests.append(BenchRequest(ids, len(ids), spec.output_len))
    return requests


def build_sessions(spec: WorkloadSpec, builder: PromptBuilder) -> list[SessionPlan]:
    return [
        SessionPlan(s, builder.prompt([f"chat{s}"], [spec.input_len]),
                    [builder.prompt([f"chat{s}.t{t}"], [spec.turn_len]) for t in range(1, spec.turns)],
                    spec.output_len)
        for s in range(spec.sessions)
    ]
