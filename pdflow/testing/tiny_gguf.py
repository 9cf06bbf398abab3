"""Tiny random models of several architectures, made with transformers and written as GGUF with
the ``gguf`` package, as llama.cpp's converter lays them out: what the tests of models given by
path serve (no model hub is needed). The tokenizer is the default model's (a GPT-2 style BPE),
taken from its ``tokenizer.json``.

``write_gguf`` writes float32 tensors, or Q8_0 for the 2-D weights (``quantized``), with the
metadata transformers' GGUF reader needs: the architecture's hyper-parameters, and the tokenizer
(``tokenizer.ggml.*``: tokens, types, merges, special ids, chat template), cut to the model's
vocabulary (its first ids and the merges among them: a small vocabulary converts in a second).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

ARCHITECTURES = ("llama", "qwen2")


def tiny_model(arch: str, vocab_size: int, seed: int = 0, std: float = 0.25):
    """A random ``arch`` model of 2 layers, hidden size 64, 4 heads (2 KV heads), fp32. The
    weights' ``std`` is large enough that greedy picks are clear (no near-ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                 initializer_range=std, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = cls(config(**shape, **({"use_sliding_window": False} if arch == "qwen2" else {})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.float().eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a llama q/k projection (rotary halves interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer_dir: str | Path, path: str | Path, quantized: bool = False) -> Path:
    """Write ``model`` (a tiny_model) with the tokenizer of ``tokenizer_dir`` as a GGUF file."""
    import gguf

    config, path = model.config, Path(path)
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, Path(tokenizer_dir), config.vocab_size)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, config.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if quantized and data.ndim == 2 and data.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokens = [""] * vocab_size
    for text, i in vocab.items():
        if i < vocab_size:
            tokens[i] = text
    types = [3 if tokens[i] in special else 1 for i in range(vocab_size)]
    kept = set(tokens)  # a vocabulary cut to its first ids keeps the merges within it: still a BPE
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    merges = [m for m in merges if (pair := m.split(" ", 1)) and pair[0] in kept and pair[-1] in kept
              and "".join(pair) in kept]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    settings = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        token = settings.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token in vocab:
            add(vocab[token])
    template = settings.get("chat_template")
    if template is None and (tokenizer_dir / "chat_template.jinja").is_file():
        template = (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)
