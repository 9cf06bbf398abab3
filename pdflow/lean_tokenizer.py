"""A model's fast tokenizer and chat template without transformers: what ingress and egress use of
a tokenizer (encode, decode, the chat template, the vocabulary), from tokenizer.json through the
``tokenizers`` library and the template through jinja2, as transformers' generic fast tokenizer
(``TokenizersBackend``) computes them.

Importing transformers and building its tokenizer, then finding its longest token, cost each stage
that tokenizes 1.2 s of CPU at every start, against 0.36 s for this (each measured six times in a
process forked, as stages are, from one that had imported torch and the stages). transformers does more
with a model's files than this does (it updates post-processors, adds missing special tokens,
reads legacy files, patches some tokenizers' regexes), so :meth:`LeanTokenizer.load` takes only a
directory where none of that applies, and says why not otherwise: the caller then loads
transformers' tokenizer. tests/test_lean_tokenizer.py checks that both give the same ids, text and
templated chats.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

# tokenizer_config.json's "tokenizer_class" values that name transformers' generic fast tokenizer
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The named special tokens, as transformers lists them (SPECIAL_TOKENS_ATTRIBUTES)
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json's keys that change nothing this tokenizer computes
_INERT_KEYS = {"backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length", "padding_side",
               "truncation_side", "model_input_names", "chat_template", "added_tokens_decoder",
               "clean_up_tokenization_spaces", "extra_special_tokens", "additional_special_tokens",
               *_NAMED_TOKENS}
# Files transformers reads besides these (legacy special tokens, added tokens, more templates)
_OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.json", "additional_chat_templates")
# Names a message's reasoning goes under (transformers copies the first one found to the others)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers patches the pre-tokenizer of some tokenizers this large (Mistral's regex)
_LARGEST_VOCAB = 100_000


class LeanTokenizer:
    """encode, decode, apply_chat_template, get_vocab, convert_tokens_to_string and len, with
    transformers' signatures for what pdflow's stages pass."""

    def __init__(self, backend, chat_template: str, special_tokens: dict[str, str]):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = special_tokens  # named special tokens the template sees (bos_token, ...)
        self._template = None

    @classmethod
    def load(cls, model_dir: str | Path) -> LeanTokenizer | str:
        """The tokenizer of ``model_dir``, or why this class cannot stand in for transformers' there."""
        model_dir = Path(model_dir)
        config = read_json_object(model_dir / "tokenizer_config.json")
        template = _chat_template(model_dir, config)
        reason = _unsupported(model_dir, config, template)
        if reason:
            return reason
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # (the library raises its own Exception for a file it cannot read)
            return f"tokenizer.json: {exc}"
        reason = _unsupported_backend(backend, config)
        if reason:
            return reason
        backend.encode_special_tokens = False
        special = {name: config[name] for name in _NAMED_TOKENS if isinstance(config.get(name), str)}
        return cls(backend, template, special)

    def token_texts(self) -> list[str]:
        """Every token's text alone, by id (special tokens included)."""
        return self.backend.decode_batch([[i] for i in range(len(self))], skip_special_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False) -> list[int] | str:
        """The chat rendered by the model's template (``tokenize``: its ids, special tokens
        already in the text). ``return_dict`` must be False (ids, not a BatchEncoding)."""
        if return_dict and tokenize:
            raise ValueError("return_dict: this tokenizer returns the ids only")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self._template is None:
            self._template = _compile(self.chat_template)
        chat = _aliased([{k: v for k, v in dict(m).items() if v is not None} for m in messages])
        text = self._template.render(messages=chat, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def read_json_object(path: Path) -> dict:
    """A JSON file's object; {} where the file is missing, unreadable or not an object."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _unsupported(model_dir: Path, config: dict, template: str | None) -> str | None:
    """Why tokenizer_config.json, a file beside it or the chat template asks for more than this class does."""
    if config.get("tokenizer_class") not in GENERIC_TOKENIZERS:
        return f"tokenizer class {config.get('tokenizer_class')!r}"
    if not (model_dir / "tokenizer.json").is_file():
        return "no tokenizer.json"
    other = [name for name in _OTHER_FILES if (model_dir / name).exists()]
    if other:
        return f"{other[0]} (read by transformers)"
    extra = sorted(set(config) - _INERT_KEYS)
    if extra:
        return f"tokenizer_config.json's {extra[0]!r}"
    if config.get("backend", "tokenizers") != "tokenizers":
        return f"backend {config['backend']!r}"
    if config.get("extra_special_tokens") or config.get("additional_special_tokens"):
        return "extra special tokens"
    if any(not isinstance(config.get(name), (str, type(None))) for name in _NAMED_TOKENS):
        return "a special token given as an object"
    if template is None:
        return "no single chat template"
    if re.search(r"\{%-?\s*generation\b", template):
        return "the chat template marks generations ({% generation %})"
    return None


def _unsupported_backend(backend, config: dict) -> str | None:
    """Why tokenizer.json needs transformers' changes to it (a post-processor to build, special
    tokens to add, truncation or padding to set, spaces to clean up, a regex to patch)."""
    if backend.get_vocab_size(with_added_tokens=True) > _LARGEST_VOCAB:
        return f"a vocabulary over {_LARGEST_VOCAB:,} tokens"
    if backend.post_processor is None:
        return "tokenizer.json has no post-processor (transformers builds one)"
    if backend.truncation is not None or backend.padding is not None:
        return "tokenizer.json sets truncation or padding"
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces"
    added = backend.get_added_tokens_decoder()
    by_content = {token.content: token for token in added.values()}
    for name in _NAMED_TOKENS:
        if config.get(name) is None:
            continue
        token = by_content.get(config[name])
        if token is None or not token.special or token.normalized:
            return f"{name} {config[name]!r} is not one of tokenizer.json's special added tokens"
    for token_id, wanted in (config.get("added_tokens_decoder") or {}).items():
        known = added.get(int(token_id)) if str(token_id).isdigit() else None
        if not isinstance(wanted, dict) or known is None or any(getattr(known, k, None) != v
                                                                for k, v in wanted.items()):
            return f"added token {token_id} differs from tokenizer.json's"
    return None


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """The model's one chat template: chat_template.jinja, else tokenizer_config.json's string."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _aliased(chat: list[dict]) -> list[dict]:
    """A message's reasoning under each name templates read it by (as transformers does)."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _compile(template: str):
    """The template in a sandbox with transformers' settings, filters and globals."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # dict() without attribute access to the type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)
