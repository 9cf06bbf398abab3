"""The compact engine's packed weights, kept on disk so that a stage starts without importing
transformers.

Packing is the slow part of loading: reading the config and ``from_pretrained`` (mostly importing
and setting up transformers' modeling code, ~5.5 s here, once per process) and quantizing every
matrix (~1 s for int4). Each stage that runs the model (prefill, decode, the colocated worker) did
both at every start. The first load of a model directory in a weight format and dtype packs as
before and saves the result, with the config's attributes and the end-of-sequence ids, under
``$PDFLOW_CACHE_DIR/packed/`` (default ``~/.cache/pdflow/packed``); later loads read it back
(memory-mapped, a fraction of a second) and compute the same function bit for bit. The
``KEEP`` most recently used copies are kept.

A packed copy is named by everything it depends on: the model directory's path and each of its
files' name, size and modification time, the weight format, the dtype, and the source of the
modules that pack (:mod:`pdflow.engine.llama`, :mod:`pdflow.engine.weights`). A model converted
again, or a change to packing, makes a new copy; old ones go once ``KEEP`` newer ones are there.
Copies are written to a temporary file and renamed (two stages starting together both pack and
one rename wins), readable by their owner only (they are pickles: ``torch.load`` runs them). A
copy that cannot be read is packed again. ``PDFLOW_PACKED_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from pdflow.engine.llama import CompactLlama
from pdflow.engine.weights import WeightFormat

log = logging.getLogger("pdflow.engine.packed_cache")

_VERSION = "2"
KEEP = 8  # packed copies kept (the least recently used beyond that are deleted)
_SOURCES = ("llama.py", "weights/base.py", "weights/formats.py")


def enabled(device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get("PDFLOW_PACKED_CACHE", "1") != "0"


def path_for(model_dir: Path, weights: str, dtype: torch.dtype) -> Path:
    """Where the packed copy of ``model_dir`` in ``weights`` and ``dtype`` is (or would be)."""
    from pdflow.paths import cache_dir

    digest = hashlib.sha256()
    model_dir = Path(model_dir).resolve()
    for part in (_VERSION, str(model_dir), weights, str(dtype)):
        digest.update(part.encode() + b"\0")
    for entry in sorted(model_dir.iterdir()):
        if entry.is_file() and not entry.name.startswith("."):
            stat = entry.stat()
            digest.update(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    engine = Path(__file__).parent
    for source in _SOURCES:
        digest.update((engine / source).read_bytes())
    name = f"{model_dir.name}-{weights}-{str(dtype).removeprefix('torch.')}-{digest.hexdigest()[:16]}.pt"
    return cache_dir() / "packed" / name


def load(path: Path, weights: WeightFormat, dtype: torch.dtype,
         device: torch.device) -> tuple[CompactLlama, SimpleNamespace, frozenset[int]] | None:
    """The model, its config (the attributes transformers' config had) and its end-of-sequence
    token ids, from the packed copy at ``path``; None if there is none or it cannot be read."""
    if not path.is_file():
        return None
    try:
        kept = torch.load(path, map_location=device, weights_only=False, mmap=True)
        with contextlib.suppress(OSError):  # used: the last to go (a read-only cache stays as it is)
            os.utime(path)
        config = SimpleNamespace(**kept["config"])
        return CompactLlama.from_packed(config, kept["model"], weights, dtype, device), config, frozenset(kept["eos"])
    except Exception as exc:  # a torn or foreign file: pack again
        log.warning("packed weights at %s unreadable (%r): packing again", path, exc)
        return None


def store(path: Path, model: CompactLlama, config: dict, eos_ids: frozenset[int]) -> None:
    """Save ``model``'s packed copy, with its config (``to_dict()``) and end-of-sequence ids, at
    ``path`` (atomically; a failure only costs the next start)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save({"model": model.packed(), "config": config, "eos": sorted(eos_ids)}, handle)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        copies = sorted(path.parent.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in copies[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not keep packed weights at %s: %r", path, exc)
