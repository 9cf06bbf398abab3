"""The lean tokenizer (pdflow.lean_tokenizer) that ingress and egress serve with gives transformers'
ids, text and templated chats for the default model; it is not taken where a model's files ask for
what only transformers does, and loading it imports no transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import jinja2
import pytest

from pdflow.lean_tokenizer import LeanTokenizer
from pdflow.serving.prompts import _max_token_bytes
from pdflow.tokenizing import load_serving_tokenizer, load_tokenizer

TEXTS = ["", "Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🙂", "<|im_start|>user\nhi<|im_end|>",
         "<|endoftext|><repo_name>x", "a" * 300, " \u200b\ufeff"]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
          {"role": "assistant", "content": "Because."}, {"role": "user", "content": "<|im_end|> and 日本"}],
         [{"role": "assistant", "content": ""}]]


@pytest.fixture(scope="module")
def pair(model_dir):
    lean = LeanTokenizer.load(model_dir)
    assert isinstance(lean, LeanTokenizer), lean
    return lean, load_tokenizer(model_dir)


def test_ids_and_text_are_transformers(pair) -> None:
    lean, theirs = pair
    assert len(lean) == len(theirs) and lean.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            assert lean.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    special_ids = [theirs.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    for _ in range(200):
        ids = [rng.choice(special_ids) if rng.random() < 0.2 else rng.randrange(len(theirs))
               for _ in range(rng.randint(1, 10))]
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    assert lean.decode(special_ids[0]) == theirs.decode(special_ids[0])


def test_every_tokens_text_alone_is_transformers(pair) -> None:
    lean, theirs = pair
    texts = lean.token_texts()
    tokens = theirs.convert_ids_to_tokens(list(range(len(theirs))))
    assert texts == [theirs.convert_tokens_to_string([token]) for token in tokens]
    assert [lean.convert_tokens_to_string([t]) for t in tokens[:2000]] == texts[:2000]
    assert _max_token_bytes(lean) == _max_token_bytes(theirs)


def test_chats_are_templated_as_transformers_templates_them(pair) -> None:
    lean, theirs = pair
    for chat in CHATS:
        for generation_prompt in (True, False):
            ours = lean.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=True,
                                            return_dict=False)
            assert ours == list(theirs.apply_chat_template(chat, add_generation_prompt=generation_prompt,
                                                           tokenize=True, return_dict=False))
            assert lean.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False) == \
                theirs.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False)
    with pytest.raises(ValueError):
        lean.apply_chat_template([])


def _model_copy(model_dir, tmp_path, config: dict | None = None, template: str | None = None, **files: str):
    (tmp_path / "tokenizer.json").symlink_to(model_dir / "tokenizer.json")
    base = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    (tmp_path / "chat_template.jinja").write_text(template or (model_dir / "chat_template.jinja").read_text())
    for name, text in files.items():
        (tmp_path / name.replace("__", ".")).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("config", "files", "reason"), [
    ({"add_bos_token": True}, {}, "'add_bos_token'"),
    ({"tokenizer_class": "GPT2Tokenizer"}, {}, "tokenizer class"),
    ({"bos_token": "<s>"}, {}, "bos_token '<s>'"),
    ({"extra_special_tokens": ["<|im_start|>"]}, {}, "extra special tokens"),
    ({}, {"special_tokens_map__json": "{}"}, "special_tokens_map.json"),
])
def test_files_that_ask_for_more_get_transformers_tokenizer(model_dir, tmp_path, config, files, reason) -> None:
    path = _model_copy(model_dir, tmp_path, config, **files)
    why = LeanTokenizer.load(path)
    assert isinstance(why, str) and reason in why
    tokenizer, why_served = load_serving_tokenizer(path)
    assert not isinstance(tokenizer, LeanTokenizer) and why_served == why


def test_a_template_that_tracks_generations_or_none_gets_transformers(model_dir, tmp_path) -> None:
    tracking = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert "generation" in LeanTokenizer.load(_model_copy(model_dir, tmp_path, template=tracking))
    (tmp_path / "chat_template.jinja").unlink()
    assert LeanTokenizer.load(tmp_path) == "no single chat template"


def test_templates_run_in_transformers_sandbox(model_dir, tmp_path) -> None:
    raising = "{{ raise_exception('no system messages') if messages[0].role == 'system' }}{{ messages | tojson }}"
    lean = LeanTokenizer.load(_model_copy(model_dir, tmp_path, template=raising))
    assert lean.apply_chat_template([{"role": "user", "content": "é"}], tokenize=False) == \
        '[{"role": "user", "content": "é"}]'  # tojson as transformers' (no HTML escaping, no ASCII)
    with pytest.raises(jinja2.TemplateError, match="no system messages"):
        lean.apply_chat_template([{"role": "system", "content": "x"}])
    escaping = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    (tmp_path / "chat_template.jinja").write_text(escaping)
    with pytest.raises(jinja2.exceptions.SecurityError):
        LeanTokenizer.load(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        LeanTokenizer.load(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_serving_the_default_model_imports_no_transformers(model_dir) -> None:
    code = ("import sys; from pdflow.tokenizing import load_serving_tokenizer; from pdflow.serving.prompts import "
            f"PromptBuilder; t, why = load_serving_tokenizer({str(model_dir)!r}); PromptBuilder(t, 8192).close(); "
            "print(type(t).__name__, why, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["LeanTokenizer", "None", "False"]
