"""pdflow's own CPU kernels: int8 and int4 weight-only matrix products (``products_fp32.c``,
``products_a8.c``, ``products_a16.c``; in blocks of 16 outputs, ``q4blocked.c``), the small fused
steps of a decode layer (RMSNorm, rotary embedding, SiLU-gated product: ``layer_ops.c``), decode
attention that reads each sequence's keys and values where they are (``attention.c``), a decode
step's layers in one call (``decode_step.c``), and the integer KV codecs' encode and decode
(``kvquant.c``). ``pdflow_kernels.h`` declares what Python calls; :func:`declare` reads the
ctypes declarations from it (:mod:`pdflow.kernels.header`).

Why our own: on this project's CPUs, PyTorch's weight-only kernels (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, the ones torchao's CPU paths call) made the decode step
1.4–5× slower than fp32's sgemm and prefill 30–50× slower, though they read a quarter to a fifth
of the bytes (docs/benchmarks.md, "Engine"). These read each weight once per call and share it across the
rows of a decode batch. At a decode step's size, one fused call also costs less than the four to
eight PyTorch operations it replaces, whose dispatch outweighs their arithmetic.

The C files are compiled on first use with the host's compiler (``$CC``, else ``cc``/``gcc``) for
the host's CPU (``-O3 -march=native -fopenmp``) into ``$PDFLOW_CACHE_DIR/kernels/`` (default
``~/.cache/pdflow/kernels``), keyed by the sources and headers, the compiler and the CPU, under a
file lock (prefill and decode start together). :func:`library` returns None, and says why once in
the log, where no compiler works; callers then fall back to PyTorch's own operations.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pdflow.kernels import header

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdflow.kernels")

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("products_fp32.c", "products_a8.c", "products_a16.c", "q4blocked.c",
                                          "layer_ops.c", "attention.c", "decode_step.c", "kvquant.c"))
HEADERS = tuple(_HERE / name for name in ("pdflow_kernels.h", "helpers.h", "portable_products.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
MAX_ROWS = 64  # rows of x one call takes (the C side's tiles); more go to sgemm, or in calls of 64 (blocked, VNNI)
MAX_INPUTS = 8192  # in_features the C side's row buffer holds


class Matrix(ctypes.Structure):
    """``pdflow_matrix`` (pdflow_kernels.h): a packed weight as the C side reads it."""

    _fields_ = [("bits", ctypes.c_int32), ("activation_bits", ctypes.c_int32), ("n_out", ctypes.c_int64),
                ("k", ctypes.c_int64), ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("low", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """``pdflow_layer`` (pdflow_kernels.h): one decoder layer's norms and packed matrices."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", Matrix), ("o", Matrix),
                ("gate_up", Matrix), ("down", Matrix)]


class CacheBlocks(NamedTuple):
    """Where a decode batch's keys and values are, as ``pdflow_decode_attention`` addresses them:
    token t of sequence b is row ``t % block_tokens`` of slot ``table[b][t // block_tokens]``; its
    key for kv head h in layer l at ``keys[l] + slot * slot_stride + row * token_stride + h *
    head_stride`` floats (values alike). ``lengths[b]``: tokens of b including the step's own.
    ``kv_keep``: None (every kv head), or uint8 ``(layers, kv_heads)``, 0 where a head is pruned
    (its query heads' attention output is then zero)."""

    lengths: "torch.Tensor"
    table: "torch.Tensor"
    table_width: int
    block_tokens: int
    keys: ctypes.Array
    values: ctypes.Array
    slot_stride: int
    token_stride: int
    head_stride: int
    kv_keep: "torch.Tensor | None" = None


_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_failure: str | None = None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return "unknown"


def _cache_dir() -> Path:
    from pdflow.paths import cache_dir

    return cache_dir() / "kernels"


def compile_library(compiler: str, sources: Iterable[Path], target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile ``sources`` (C files; the headers they include beside them) into the shared library
    ``target``; RuntimeError with the compiler's message if it fails."""
    result = subprocess.run([compiler, *flags, "-o", str(target), *map(str, sources), *LIBS],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")


def _build_key(compiler: str) -> str:
    """What the library is built from: every source and header (a header's change changes the
    library as a source's does), the compiler's version, the CPU and the flags."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(version.encode() + _cpu_identity().encode() + " ".join(FLAGS).encode())
    return digest.hexdigest()[:16]


def _build(compiler: str) -> Path:
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"pdflow-kernels-{_build_key(compiler)}.so"
    if target.exists():
        return target
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built by another process while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            built = Path(tmp) / target.name
            compile_library(compiler, SOURCES, built)
            os.replace(built, target)
    return target


_SCALARS = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float}


def ctype(c_type: str) -> type | None:
    """The ctypes type that passes a (normalized, :func:`header.normalize`) C type: a pointer as
    ``c_void_p`` (tensors' ``data_ptr()``, ctypes arrays, None for NULL), ``pdflow_layer *`` as a
    pointer to :class:`Layer`; ValueError for a type the header should not use."""
    if c_type == "pdflow_layer *":
        return ctypes.POINTER(Layer)
    if c_type.endswith("*"):
        return ctypes.c_void_p
    if c_type not in _SCALARS:
        raise ValueError(f"pdflow_kernels.h uses {c_type!r}, which pdflow.kernels cannot pass through ctypes")
    return _SCALARS[c_type]


def declare(lib: ctypes.CDLL, *, missing_ok: bool = False) -> ctypes.CDLL:
    """``lib`` with every function of pdflow_kernels.h given its argtypes and restype, read from the
    header's prototypes. A function the build lacks raises RuntimeError, unless ``missing_ok``
    (a build of an older commit's sources, experiments/compare_kernel_builds.py: its functions are
    declared as this header has them)."""
    for prototype in header.read().prototypes.values():
        if not hasattr(lib, prototype.name):
            if missing_ok:
                continue
            raise RuntimeError(f"the kernels' build has no {prototype.name}, which pdflow_kernels.h declares")
        function = getattr(lib, prototype.name)
        function.argtypes = [ctype(p.type) for p in prototype.parameters]
        function.restype = ctype(prototype.result)
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (and why, logged once) if they cannot be."""
    global _loaded, _failure
    if _loaded is not None:  # every matrix product asks: no lock once built
        return _loaded
    with _lock:
        if _loaded is None and _failure is None:
            compiler = _compiler()
            if os.environ.get("PDFLOW_NO_KERNELS"):
                _failure = "PDFLOW_NO_KERNELS is set"
            elif compiler is None:
                _failure = "no C compiler ($CC, cc or gcc) on PATH"
            else:
                try:
                    _loaded = declare(ctypes.CDLL(str(_build(compiler))))
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    _failure = str(exc)
            if _failure:
                log.warning("pdflow's int8/int4 kernels are unavailable (%s); quantized weights will be "
                            "dequantized by PyTorch on every call, which is slow", _failure)
        return _loaded


def argmax_rows(logits: "torch.Tensor") -> list[int]:
    """Each row's argmax of 2-D ``logits`` (torch.argmax's answer: the first largest, or the first
    NaN), through the kernel where it runs (fp32 on the CPU), else torch.argmax."""
    import torch

    lib = library() if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 else None
    if lib is None or logits.shape[1] == 0:
        return torch.argmax(logits, dim=-1).tolist()
    logits = logits.contiguous()
    out = (ctypes.c_int64 * logits.shape[0])()
    lib.pdflow_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out)
    return list(out)


def unavailable_reason() -> str | None:
    library()
    return _failure
