"""pdflow's own CPU kernels: int8 and int4 weight-only matrix products, the small fused steps of
a decode layer (RMSNorm, rotary embedding, SiLU-gated product) and decode attention that reads
each sequence's keys and values where they are (``qgemm.c``); the integer KV codecs' encode and
decode (``kvquant.c``).

Why our own: on this project's CPUs, PyTorch's weight-only kernels (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, the ones torchao's CPU paths call) made the decode step
1.4–5× slower than fp32's sgemm and prefill 30–50× slower, though they read a quarter to a fifth
of the bytes (docs/benchmarks.md, "Engine"). These read each weight once per call and share it across the
rows of a decode batch. At a decode step's size, one fused call also costs less than the four to
eight PyTorch operations it replaces, whose dispatch outweighs their arithmetic.

The C files are compiled on first use with the host's compiler (``$CC``, else ``cc``/``gcc``) for
the host's CPU (``-O3 -march=native -fopenmp``) into ``$PDFLOW_CACHE_DIR/kernels/`` (default
``~/.cache/pdflow/kernels``), keyed by the source, the compiler and the CPU, under a file lock
(prefill and decode start together). :func:`library` returns None, and says why once in the log,
where no compiler works; callers then fall back to PyTorch's own operations.
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
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdflow.kernels")

SOURCE = Path(__file__).with_name("qgemm.c")
SOURCES = (SOURCE, Path(__file__).with_name("kvquant.c"), Path(__file__).with_name("q4blocked.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
MAX_ROWS = 64  # rows of x one call takes (the C side's tiles); more go to sgemm
MAX_INPUTS = 8192  # in_features the C side's row buffer holds


class Matrix(ctypes.Structure):
    """``pdflow_matrix``: a packed weight as the C side reads it (see qgemm.c)."""

    _fields_ = [("bits", ctypes.c_int32), ("activation_bits", ctypes.c_int32), ("n_out", ctypes.c_int64),
                ("k", ctypes.c_int64), ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("low", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """``pdflow_layer``: one decoder layer's norms and packed matrices."""

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


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES) + version.encode() + _cpu_identity().encode()
                         + " ".join(FLAGS).encode()).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"qgemm-{key}.so"
    if target.exists():
        return target
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built by another process while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), *LIBS],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pdflow_q8_gemm.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.pdflow_q4_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, i32]
    lib.pdflow_q8a8_gemm.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.pdflow_q4a8_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, i32]
    lib.pdflow_q8a16_gemm.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.pdflow_q4a16_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, i32]
    lib.pdflow_q8_dequantize.argtypes = [p, p, i64, i64, p, i32]
    lib.pdflow_q4_dequantize.argtypes = [p, p, p, i64, i64, p, i32]
    lib.pdflow_rms_norm.argtypes = [p, p, i64, i64, ctypes.c_float, p]
    lib.pdflow_rope.argtypes = [p, i64, i64, i64, i64, p, p, p, p]
    lib.pdflow_silu_mul.argtypes = [p, i64, i64, p]
    lib.pdflow_decode_attention.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, p, p, i64, i64, i64,
                                            p, p, i64, i64, ctypes.c_float, p, p, i32]
    lib.pdflow_decode_layers.argtypes = [ctypes.POINTER(Layer), i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                         p, p, p, p, p, i64, i64, p, p, i64, i64, i64, ctypes.c_float, p, i32]
    if hasattr(lib, "pdflow_argmax_rows"):  # not in builds of earlier commits (compare_kernel_builds.py)
        lib.pdflow_argmax_rows.argtypes = [p, i64, i64, p]
        lib.pdflow_argmax_rows.restype = None
    if hasattr(lib, "pdflow_q4b_gemm"):  # (not in a build of qgemm.c alone)
        lib.pdflow_q4b_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, i32, i32]
        lib.pdflow_q4b_gemm.restype = i32
        lib.pdflow_q4b_paths.argtypes = []
        lib.pdflow_q4b_paths.restype = i32
        lib.pdflow_q4b_dequantize.argtypes = [p, p, p, i64, i64, p, i32]
        lib.pdflow_q4b_dequantize.restype = None
        lib.pdflow_q8b_gemm.argtypes = [p, i64, i64, p, p, i64, p, i32, i32]
        lib.pdflow_q8b_gemm.restype = i32
        lib.pdflow_q8b_dequantize.argtypes = [p, p, i64, i64, p, i32]
        lib.pdflow_q8b_dequantize.restype = None
    if hasattr(lib, "pdflow_kv_encode"):  # a build of qgemm.c alone (scripts/compare_kernel_builds.py) has none
        lib.pdflow_kv_encode.argtypes = [p, i64, i64, i64, i32, i64, i32, i32, p, i64]
        lib.pdflow_kv_encode.restype = i32
        lib.pdflow_kv_decode.argtypes = [p, i64, i64, i64, i64, i32, i64, i32, i32, p]
        lib.pdflow_kv_decode.restype = None
    for fn in (lib.pdflow_decode_layers, lib.pdflow_q8_gemm, lib.pdflow_q4_gemm, lib.pdflow_q8a8_gemm, lib.pdflow_q4a8_gemm,
               lib.pdflow_q8a16_gemm, lib.pdflow_q4a16_gemm, lib.pdflow_q8_dequantize, lib.pdflow_q4_dequantize,
               lib.pdflow_rms_norm, lib.pdflow_rope, lib.pdflow_silu_mul, lib.pdflow_decode_attention):
        fn.restype = None
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
                    _loaded = _declare(ctypes.CDLL(str(_build(compiler))))
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
