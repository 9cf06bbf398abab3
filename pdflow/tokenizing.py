"""A model directory's tokenizer and limits, torch-free: ingress and egress load them without the
engine (importing torch costs each of those stages about 1.5 s of CPU at start)."""

from __future__ import annotations

from pathlib import Path

from pdflow.lean_tokenizer import GENERIC_TOKENIZERS, LeanTokenizer, read_json_object


def load_tokenizer(model_dir: str | Path):
    """The model's tokenizer, as ``AutoTokenizer`` gives it. Where the directory names the generic
    fast tokenizer (and has its tokenizer.json), that class is built directly: AutoTokenizer
    would first read the model's config through its config class, whose import pulls in
    torch.distributed, about 1 s of every stage start that tokenizes."""
    from pdflow.log import quiet_transformers

    model_dir = Path(model_dir)
    name = read_json_object(model_dir / "tokenizer_config.json").get("tokenizer_class")
    if name in GENERIC_TOKENIZERS and (model_dir / "tokenizer.json").is_file():
        import transformers

        quiet_transformers()
        generic = getattr(transformers, name, None)
        if generic is not None:
            return generic.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    quiet_transformers()
    return AutoTokenizer.from_pretrained(model_dir)


def load_serving_tokenizer(model_dir: str | Path):
    """The tokenizer a stage serves with, and why transformers' was needed (None where it was not):
    :class:`pdflow.lean_tokenizer.LeanTokenizer` where it computes what transformers' tokenizer
    would (a stage starts with 0.85 s less CPU), else :func:`load_tokenizer`'s."""
    lean = LeanTokenizer.load(model_dir)
    if isinstance(lean, LeanTokenizer):
        return lean, None
    return load_tokenizer(model_dir), lean


def model_limits(model_dir: str | Path) -> tuple[int, int]:
    """(max_position_embeddings, vocab_size) of the model in ``model_dir``: from config.json where
    it states them at its top level (no transformers import), else from AutoConfig; 2048 and 0
    where neither says."""
    config = read_json_object(Path(model_dir) / "config.json")
    if "max_position_embeddings" not in config or "vocab_size" not in config:
        from transformers import AutoConfig

        from pdflow.log import quiet_transformers

        quiet_transformers()
        config = AutoConfig.from_pretrained(model_dir).to_dict()
    return int(config.get("max_position_embeddings") or 2048), int(config.get("vocab_size") or 0)
