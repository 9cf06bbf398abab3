"""What each stage costs, for the simulator: a *profile*, measured on a machine (``pdflow profile``)
or written by hand for one that is not here (with its source stated).

A profile is JSON::

    {"name": "...", "source": "how these numbers were obtained",
     "layers": 30, "kv_bytes_per_token": 46080,
     "prefill": {"tokens": [128, 512, 2048], "seconds": [0.05, 0.21, 1.1]},
     "decode": {"batch": [1, 8, 32], "context": [256, 2048], "seconds": [[...], [...]]},
     "link": {"gbit_per_s": 25.0, "latency_s": 0.0001},
     "fetch_gbit_per_s": 25.0, "replica_start_s": 1.0, "max_batch": 32}

- ``prefill``: one replica's time to compute a prompt of ``tokens`` tokens from nothing. With a
  cached prefix of ``c`` tokens, the ``n`` new ones cost ``F(c + n) - F(c)``: causal attention
  makes token ``i`` cost what it costs in any prompt, so the difference is the new tokens' own
  share, their attention over the prefix included. ``F`` is linear between the points and
  extended along the last segment's slope beyond them.
- ``decode``: one step of a batch of ``batch`` sequences whose mean context is ``context``,
  bilinear between the grid's points (``seconds[i][j]``: ``context[i]``, ``batch[j]``), extended
  linearly beyond it.
- ``link``: the prefill -> store -> decode path's speed (decimal Gbit/s) and latency; KV streams
  layer by layer (:func:`pdflow.plan.transfer.transfer`). ``fetch_gbit_per_s``: between two
  stores. ``replica_start_s``: a replica the scaler starts takes this long to be ready.
- ``pipeline``: what the stages add to the bare engine, measured through a real pipeline
  (``pdflow profile --pipeline``): ``prefill_overhead_s`` more per prefill (tokenizing, routing,
  the store's lease, the messages) and ``decode_overhead_s`` more per decode step (sampling,
  stop rules, the token messages to ingress and the client). 0 where not measured.
  ``decode_gap_ratios``: ``{"busy": [...], "idle": [...]}``, the percentiles 0, 1, ..., 100 of a
  running sequence's gap between tokens over the profile's step for its batch and context,
  measured through the same pipeline while a prefill computes beside it (``busy``) and while none
  does (``idle``): on a machine whose stages share cores, the CPU the other stages take when a
  prompt comes in (receiving and forwarding its KV, routing, streaming) shows as longer and more
  scattered gaps, which mean costs alone cannot give. The simulator draws each gap's ratio from
  them (prefill replica *i* beside decode replica *i*, as one host holds one of each). Absent:
  every gap is the step.
  ``worker_ratios``: ``{"prefill": [...]}``, the same for the colocated worker's iterations that
  prefill (``pdflow profile --worker``, through a real colocated server): the percentiles of such
  an iteration's time (its prefill work and the decode step after it, one gap of a running
  answer) over what the profile predicts for it. ``worker_step_extra_s``: ``{"1": [...], "16":
  [...]}``, the percentiles of the seconds the worker's decode step alone takes beyond the
  profile's step, at each batch size measured (streams of that many answers through the same
  server): the worker's loop, its messages and ingress on the same cores add a cost per step and
  one per sequence, not a share of the step. The simulator draws each iteration's ratio, and each
  step's extra (linear in the batch size between and beyond the sizes measured, at the drawn
  quantile), from them: which prompt arrives before a batch ends turns on such scatter. Absent:
  every iteration as predicted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Profile"]


def _quantile(ratios: list[float] | None, u: float) -> float:
    """Linear between the percentiles ``ratios`` at quantile ``u`` (0..1); 1 without them."""
    if not ratios:
        return 1.0
    x = u * (len(ratios) - 1)
    i = min(int(x), len(ratios) - 2)
    return ratios[i] + (ratios[i + 1] - ratios[i]) * (x - i)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended along the end segments."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] else 1.0)
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class Profile:
    name: str
    layers: int
    kv_bytes_per_token: float
    prefill_tokens: list[int]
    prefill_seconds: list[float]
    decode_batch: list[int]
    decode_context: list[int]
    decode_seconds: list[list[float]]  # [context index][batch index]
    link_gbit_per_s: float = 25.0
    link_latency_s: float = 0.0
    fetch_gbit_per_s: float = 25.0
    replica_start_s: float = 1.0
    max_batch: int = 32
    source: str = ""
    prefill_overhead_s: float = 0.0
    decode_overhead_s: float = 0.0
    decode_gap_ratios: dict[str, list[float]] = field(default_factory=dict)  # "busy"/"idle" -> 101 percentiles
    worker_ratios: dict[str, list[float]] = field(default_factory=dict)  # "prefill" -> 101 percentiles
    worker_step_extra_s: dict[int, list[float]] = field(default_factory=dict)  # batch -> 101 percentiles
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check()

    # --- costs ------------------------------------------------------------------------------

    def full_prefill_s(self, tokens: float) -> float:
        """F: a prompt of ``tokens`` computed from nothing."""
        if tokens <= 0:
            return 0.0
        first = self.prefill_seconds[0] * tokens / self.prefill_tokens[0]  # below the first point: pro rata
        return first if tokens < self.prefill_tokens[0] else _interp(self.prefill_tokens, self.prefill_seconds, tokens)

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0) -> float:
        """``new_tokens`` computed after ``cached_tokens`` read from a store (and the stage's own
        overhead)."""
        compute = self.full_prefill_s(cached_tokens + new_tokens) - self.full_prefill_s(cached_tokens)
        return max(0.0, compute) + self.prefill_overhead_s

    def decode_step_s(self, batch: int, context: float) -> float:
        """One step of ``batch`` sequences of mean ``context`` tokens."""
        rows = [_interp(self.decode_batch, row, batch) for row in self.decode_seconds]
        return max(1e-6, _interp(self.decode_context, rows, context)) + self.decode_overhead_s

    def gap_ratio(self, busy: bool, u: float) -> float:
        """The ratio of a gap to the step at quantile ``u`` (0..1) of the measured distribution
        (``busy``: beside a prefill); 1 without one."""
        return _quantile(self.decode_gap_ratios.get("busy" if busy else "idle"), u)

    def worker_ratio(self, u: float) -> float:
        """The colocated worker's ratio of an iteration that prefills to its prediction at
        quantile ``u``; 1 without one."""
        return _quantile(self.worker_ratios.get("prefill"), u)

    def worker_step_extra(self, batch: int, u: float) -> float:
        """The seconds the colocated worker's decode step alone takes beyond :meth:`decode_step_s`
        at quantile ``u`` of those measured, linear in ``batch`` between (and beyond) the batch
        sizes measured; 0 without them."""
        if not self.worker_step_extra_s:
            return 0.0
        sizes = sorted(self.worker_step_extra_s)
        extras = [_quantile(self.worker_step_extra_s[size], u) for size in sizes]
        return extras[0] if len(sizes) == 1 else _interp(sizes, extras, batch)

    # --- files ------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """ValueError naming the file and the key that is missing or wrong."""
        from pdflow.plan.shapes import read_json

        path = Path(path)
        return cls.from_dict(read_json(path), str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "profile") -> Profile:
        try:
            link = raw.get("link", {})
            return cls(
                name=str(raw.get("name", where)), layers=int(raw["layers"]),
                kv_bytes_per_token=float(raw["kv_bytes_per_token"]),
                prefill_tokens=[int(x) for x in raw["prefill"]["tokens"]],
                prefill_seconds=[float(x) for x in raw["prefill"]["seconds"]],
                decode_batch=[int(x) for x in raw["decode"]["batch"]],
                decode_context=[int(x) for x in raw["decode"]["context"]],
                decode_seconds=[[float(x) for x in row] for row in raw["decode"]["seconds"]],
                link_gbit_per_s=float(link.get("gbit_per_s", 25.0)), link_latency_s=float(link.get("latency_s", 0.0)),
                fetch_gbit_per_s=float(raw.get("fetch_gbit_per_s", link.get("gbit_per_s", 25.0))),
                replica_start_s=float(raw.get("replica_start_s", 1.0)), max_batch=int(raw.get("max_batch", 32)),
                source=str(raw.get("source", "")),
                prefill_overhead_s=float(raw.get("pipeline", {}).get("prefill_overhead_s", 0.0)),
                decode_overhead_s=float(raw.get("pipeline", {}).get("decode_overhead_s", 0.0)),
                decode_gap_ratios={k: [float(x) for x in v]
                                   for k, v in raw.get("pipeline", {}).get("decode_gap_ratios", {}).items()},
                worker_ratios={k: [float(x) for x in v]
                               for k, v in raw.get("pipeline", {}).get("worker_ratios", {}).items()},
                worker_step_extra_s={int(k): [float(x) for x in v]
                                     for k, v in raw.get("pipeline", {}).get("worker_step_extra_s", {}).items()},
                extra=dict(raw.get("extra", {})))
        except KeyError as exc:
            raise ValueError(f"{where}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "layers": self.layers,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "prefill": {"tokens": self.prefill_tokens, "seconds": self.prefill_seconds},
                "decode": {"batch": self.decode_batch, "context": self.decode_context, "seconds": self.decode_seconds},
                "link": {"gbit_per_s": self.link_gbit_per_s, "latency_s": self.link_latency_s},
                "fetch_gbit_per_s": self.fetch_gbit_per_s, "replica_start_s": self.replica_start_s,
                "max_batch": self.max_batch, "extra": self.extra,
                "pipeline": {"prefill_overhead_s": self.prefill_overhead_s,
                             "decode_overhead_s": self.decode_overhead_s,
                             **({"decode_gap_ratios": self.decode_gap_ratios} if self.decode_gap_ratios else {}),
                             **({"worker_ratios": self.worker_ratios} if self.worker_ratios else {}),
                             **({"worker_step_extra_s": {str(k): v for k, v in self.worker_step_extra_s.items()}}
                                if self.worker_step_extra_s else {})}}

    def _check(self) -> None:
        def rising(name: str, xs: list) -> None:
            if not xs or any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] <= 0:
                raise ValueError(f"{self.name}: {name} must be positive and rising, got {xs}")

        rising("prefill.tokens", self.prefill_tokens)
        rising("decode.batch", self.decode_batch)
        rising("decode.context", self.decode_context)
        if len(self.prefill_seconds) != len(self.prefill_tokens) or min(self.prefill_seconds) <= 0:
            raise ValueError(f"{self.name}: prefill.seconds must be one positive time per prefill.tokens")
        if len(self.decode_seconds) != len(self.decode_context) or \
                any(len(row) != len(self.decode_batch) or min(row) <= 0 for row in self.decode_seconds):
            raise ValueError(f"{self.name}: decode.seconds must be a row per decode.context, a positive time per "
                             "decode.batch")

        def percentiles(name: str, key, values: list[float], positive: bool) -> None:
            if len(values) < 2 or (positive and min(values) <= 0) or any(b < a for a, b in zip(values, values[1:])):
                raise ValueError(f"{self.name}: pipeline.{name}[{key!r}] must be rising{' positive' * positive} "
                                 f"percentiles, got {values[:3]}...")

        for name, table, keys in (("decode_gap_ratios", self.decode_gap_ratios, ("busy", "idle")),
                                  ("worker_ratios", self.worker_ratios, ("prefill",))):
            for key, ratios in table.items():
                if key not in keys:
                    raise ValueError(f"{self.name}: pipeline.{name} takes {' and '.join(map(repr, keys))}, not {key!r}"
                                     + (" (a step alone is pipeline.worker_step_extra_s)" if key == "decode" else ""))
                percentiles(name, key, ratios, True)
        for batch, extras in self.worker_step_extra_s.items():
            if batch <= 0:
                raise ValueError(f"{self.name}: pipeline.worker_step_extra_s is keyed by batch sizes > 0, not {batch}")
            percentiles("worker_step_extra_s", str(batch), extras, False)
        for name in ("layers", "kv_bytes_per_token", "link_gbit_per_s", "fetch_gbit_per_s", "max_batch"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name} must be > 0, got {getattr(self, name)}")
