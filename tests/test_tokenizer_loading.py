"""``load_tokenizer`` gives what ``AutoTokenizer`` gives, by its shorter path where the model
directory names transformers' generic fast tokenizer, and AutoTokenizer's own answer elsewhere."""

from __future__ import annotations

import json
import shutil

import pytest

from pdflow.tokenizing import load_tokenizer, model_limits

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🙂", "<|im_start|>user"]


def _auto_tokenizer(path):
    """transformers' own answer (imported here: at the top, each test worker paid 0.7 s of CPU for
    it while collecting, the workers that never run this module too)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_the_default_models_tokenizer_is_autotokenizers(model_dir) -> None:
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "TokenizersBackend", "PreTrainedTokenizerFast")  # the shorter path is the one taken
    _same(load_tokenizer(model_dir), _auto_tokenizer(model_dir))


@pytest.mark.parametrize("tokenizer_class", ["GPT2Tokenizer", None])
def test_other_tokenizer_classes_go_through_autotokenizer(model_dir, tmp_path, tokenizer_class) -> None:
    for name in ("tokenizer.json", "config.json", "chat_template.jinja", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        config.pop("tokenizer_class")
    else:
        config["tokenizer_class"] = tokenizer_class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    _same(load_tokenizer(tmp_path), _auto_tokenizer(tmp_path))


def test_model_limits_read_config_json_and_fall_back_to_autoconfig(model_dir, tmp_path) -> None:
    assert model_limits(model_dir) == (8192, 49152)
    config = json.loads((model_dir / "config.json").read_text())
    del config["vocab_size"]  # AutoConfig fills in the architecture's default
    (tmp_path / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig

    assert model_limits(tmp_path) == (8192, AutoConfig.from_pretrained(tmp_path).vocab_size)
