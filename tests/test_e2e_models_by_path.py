"""Models given by path: tiny random models of two architectures, made with transformers, written
as GGUF files with the ``gguf`` package (pdflow.testing.tiny_gguf), served by `pdflow run
--model FILE.gguf` (converted once into a fresh model cache), with the same greedy output as
transformers' own model. Also what `pdflow validate` says of a GGUF, and what it refuses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pdflow.testing.local_http import openai_client
from pdflow.testing.server import PdflowServer
from pdflow.testing.tiny_gguf import tiny_model, write_gguf

pytestmark = pytest.mark.e2e
VOCAB = 1024  # the default model's first 1,024 tokens and the merges among them
PROMPT = [1, 504, 770, 13, 906, 288, 705, 30]  # token ids


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from pdflow.engine import load_tokenizer

    return load_tokenizer(model_dir)


def _share_the_kernels(cache: Path) -> None:
    """A fresh model cache whose compiled kernels are the session's (built once), so that the
    server's stages do not compile them again (seconds of both cores)."""
    from pdflow import kernels, paths

    assert kernels.library() is not None, kernels.unavailable_reason()
    cache.mkdir(parents=True)
    (cache / "kernels").symlink_to(paths.cache_dir() / "kernels", target_is_directory=True)


@pytest.mark.parametrize("arch,mode", [("qwen2", "disaggregated"), ("llama", "colocated")])
def test_a_gguf_file_is_served_with_transformers_greedy_output(arch, mode, model_dir, tokenizer, tmp_path):
    model = tiny_model(arch, VOCAB, seed=3)
    gguf_file = write_gguf(model, model_dir, tmp_path / f"tiny-{arch}.gguf")
    with torch.no_grad():
        reference = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(PROMPT):].tolist()
    expected = tokenizer.decode(reference, skip_special_tokens=True)
    assert len(reference) == 12 and expected.strip()
    kwargs = {"mode": "colocated", "chunked_prefill_tokens": 64} if mode == "colocated" else {}
    _share_the_kernels(tmp_path / "cache")
    flags = ("--model", str(gguf_file), "--set", 'model.weights="fp32"', "--served-model-name", "tiny")
    with PdflowServer(tmp_path, args=flags, env={"PDFLOW_CACHE_DIR": str(tmp_path / "cache")}, **kwargs) as server:
        client = openai_client(server.url, timeout=120)
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected
        assert client.models.list().data[0].id == "tiny"
        assert "model.convert.done" in server.log()
    converted = list((tmp_path / "cache" / "models" / "gguf").glob(f"tiny-{arch}-*"))
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()


def test_validate_names_the_architecture_and_the_engine_and_refuses_what_cannot_run(model_dir, tokenizer, tmp_path,
                                                                                     capsys):
    import gguf

    from pdflow import cli

    def _validate(*args: str) -> subprocess.CompletedProcess[str]:
        """`pdflow validate` in this process (its imports are loaded already)."""
        try:
            code = cli.main(["validate", *args])
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    quantized = write_gguf(tiny_model("qwen2", VOCAB), model_dir, tmp_path / "q8.gguf", quantized=True)
    result = _validate("--model", str(quantized))
    assert result.returncode == 0, result.stderr
    assert "architecture: qwen2, compact engine; tensors F32, Q8_0" in result.stdout

    def bare(name: str, tokenizer_too: bool, tensor: np.ndarray) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        if tokenizer_too:
            writer.add_tokenizer_model("gpt2")
            writer.add_token_list(["a", "b"])
        writer.add_tensor("token_embd.weight", tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / name)

    no_tokenizer = _validate("--model", bare("no-tok.gguf", False, np.zeros((2, 32), np.float32)))
    assert no_tokenizer.returncode == 2 and "model.source: no-tok.gguf has no tokenizer" in no_tokenizer.stderr
    int_tensors = _validate("--model", bare("ints.gguf", True, np.zeros((2, 32), np.int32)))
    assert int_tensors.returncode == 2 and "tensors of type I32, which cannot be dequantized" in int_tensors.stderr
    hub = _validate("--model", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.returncode == 2 and "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct" in hub.stderr
