"""A compact Llama-family forward for serving.

Weights come from a Hugging Face model loaded by transformers; this module keeps only what a
forward pass reads: the embedding table, per layer two norms and four packed matrices (queries,
keys and values fused into one; gate and up fused into one), the final norm and the output
projection, plus a rotary table computed once for every position. There is no mask building and
no cache bookkeeping: each layer hands its new keys and values to ``cache.update`` (the same
protocol as transformers' caches: ``update(keys, values, layer) -> (all keys, all values)``, both
``(batch, kv_heads, tokens, head_dim)``) and attends over what it returns; or, for one-token
steps, to ``cache.attend(query, keys, values, layer, scale)`` where the cache has it (decode's
batch, which attends in place with pdflow's kernel). Where the cache also says where its blocks
are (``cache.blocks()``) and every matrix has a C form, a one-token step runs all layers in one
call into the kernels (``pdflow_decode_layers``).

Keys come out of the rotary step token-major and contiguous, ``(batch, tokens, kv_heads,
head_dim)``, and values as a token-major view into the fused projection's output; the tensors
handed to the cache are head-major views of them, so a cache that wants token-major memory
(prefill's layer streaming) gets the keys without a copy. A prefill cache that says where each
layer's KV belongs (``cache.targets(layer)``: runs of rows and their memory, blocks of the KV
store's arena) gets its keys rotated straight into that memory and its values gathered there out
of the fused projection, and attends from it.

Numerics follow transformers' Llama: RMSNorm in fp32, rotary ``x * cos + rotate_half(x) * sin``
from the same table, ``scaled_dot_product_attention`` with the key/value heads shared across
query groups, SiLU-gated MLP. In fp32 the only difference is the order of float operations in
the fused matrix products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdflow import kernels
from pdflow.engine.weights import PackedLinear, WeightFormat
from pdflow.model_files import COMPACT_TYPES as SUPPORTED_TYPES
from pdflow.model_files import compact_unsupported


def unsupported_reason(config) -> str | None:
    """None if this module can run a model with ``config``, else why not."""
    return compact_unsupported(config)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


# Where a prefill's KV goes, for a cache that has it computed in place (``cache.targets(layer)``):
# rows ``a .. b`` of the tokens computed, and the (b - a, kv_heads, head_dim) contiguous memory
# their keys and their values are written to (blocks of the KV store's arena).
Target = tuple[int, int, torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(..., head_dim)``, as transformers' ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchSteps:
    """A layer's small steps in PyTorch operations: any dtype, any device, any number of rows."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``qkv`` ``(rows, (heads + 2 kv_heads) head_dim)``, ``cos``/``sin`` ``(rows, head_dim)`` ->
        rotated queries ``(rows, heads, head_dim)`` and keys ``(rows, kv_heads, head_dim)``, contiguous."""
        split = qkv.view(qkv.shape[0], heads + 2 * kv_heads, head_dim)
        cos, sin = cos[:, None], sin[:, None]
        return rotate(split[:, :heads], cos, sin), rotate(split[:, heads: heads + kv_heads], cos, sin)

    def rope_into(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                  head_dim: int, runs: list[Target]) -> torch.Tensor:
        """Rotated queries as :meth:`rope` returns them; each run's rotated keys and its values
        written straight into the run's memory instead (see :data:`Target`)."""
        split = qkv.view(qkv.shape[0], heads + 2 * kv_heads, head_dim)
        half = head_dim // 2
        for a, b, keys, values in runs:
            x, c, s = split[a:b, heads: heads + kv_heads], cos[a:b, None], sin[a:b, None]
            torch.add(x * c, torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s, out=keys)  # rotate()
            values.copy_(split[a:b, heads + kv_heads:])
        return rotate(split[:, :heads], cos[:, None], sin[:, None])

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedSteps(TorchSteps):
    """The same steps as one call each into pdflow's kernels (fp32 on the CPU): at a decode step's
    few rows, PyTorch's per-operation dispatch costs more than the arithmetic."""

    def __init__(self, lib):
        self.lib = lib

    def norm(self, x, weight, eps):
        out = torch.empty_like(x)
        self.lib.pdflow_rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
        return out

    def rope(self, qkv, cos, sin, heads, kv_heads, head_dim):
        rows = qkv.shape[0]
        q = torch.empty(rows, heads, head_dim)
        k = torch.empty(rows, kv_heads, head_dim)
        self.lib.pdflow_rope(qkv.data_ptr(), rows, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                             q.data_ptr(), k.data_ptr())
        return q, k

    def rope_into(self, qkv, cos, sin, heads, kv_heads, head_dim, runs):
        rows, width, size = qkv.shape[0], (heads + 2 * kv_heads) * head_dim, qkv.element_size()
        q = torch.empty(rows, heads, head_dim)
        split = qkv.view(rows, heads + 2 * kv_heads, head_dim)
        for a, b, keys, values in runs:
            if not 0 <= a < b <= rows or keys.shape != (b - a, kv_heads, head_dim) or not keys.is_contiguous() \
                    or keys.dtype != torch.float32:  # C writes b - a rows there, unchecked
                raise ValueError(f"keys of rows {a}..{b} cannot go into a {tuple(keys.shape)} {keys.dtype} tensor")
            self.lib.pdflow_rope(qkv.data_ptr() + a * width * size, b - a, heads, kv_heads, head_dim,
                                 cos.data_ptr() + a * head_dim * size, sin.data_ptr() + a * head_dim * size,
                                 q.data_ptr() + a * heads * head_dim * size, keys.data_ptr())
            values.copy_(split[a:b, heads + kv_heads:])
        return q

    def silu_mul(self, gate_up):
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter)
        self.lib.pdflow_silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
        return out


TORCH_STEPS = TorchSteps()


class Layer:
    __slots__ = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")

    def __init__(self, input_norm, qkv: PackedLinear, o: PackedLinear, post_norm, gate_up: PackedLinear,
                 down: PackedLinear):
        self.input_norm, self.qkv, self.o = input_norm, qkv, o
        self.post_norm, self.gate_up, self.down = post_norm, gate_up, down


def _bias(module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().float().contiguous()


class CompactLlama:
    """``forward(input_ids, positions, mask, cache)`` -> logits of each row's last position."""

    # what a packed copy keeps (pdflow.engine.packed_cache); the kernels' views are rebuilt from it
    PACKED = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "eps", "scaling", "layers", "embed", "norm",
              "lm_head", "cos", "sin")

    def __init__(self, hf_model: torch.nn.Module, weights: WeightFormat, dtype: torch.dtype, device: torch.device):
        config = hf_model.config
        if reason := unsupported_reason(config):
            raise ValueError(f"the compact engine cannot run this model: {reason}")
        inner = hf_model.model
        self.config, self.dtype, self.device, self.weights = config, dtype, device, weights
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim ** -0.5

        def norm(module) -> torch.Tensor:
            return module.weight.detach().to(device=device, dtype=dtype).contiguous()

        def pack(*modules, output=False) -> PackedLinear:
            parts = [m.weight.detach().float() for m in modules]
            weight = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(device)
            biases = [_bias(m) for m in modules]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else torch.zeros(m.weight.shape[0]) for b, m in zip(biases, modules)]).to(device)
            return weights.pack(weight, bias, output=output)

        self.layers: list[Layer] = []
        for hf_layer in inner.layers[: self.num_layers]:
            attn, mlp = hf_layer.self_attn, hf_layer.mlp
            self.layers.append(Layer(
                norm(hf_layer.input_layernorm),
                pack(attn.q_proj, attn.k_proj, attn.v_proj),
                pack(attn.o_proj),
                norm(hf_layer.post_attention_layernorm),
                pack(mlp.gate_proj, mlp.up_proj),
                pack(mlp.down_proj),
            ))
        self.embed = inner.embed_tokens.weight.detach().to(device=device, dtype=dtype).contiguous()
        self.norm = norm(inner.norm)
        self.lm_head = pack(hf_model.lm_head, output=True)
        rotary = inner.rotary_emb
        positions = torch.arange(int(getattr(config, "max_position_embeddings", 2048)), dtype=torch.long)[None]
        with torch.inference_mode():
            cos, sin = rotary(torch.empty(0, dtype=dtype), positions)
        self.cos, self.sin = cos[0].to(device).contiguous(), sin[0].to(device).contiguous()  # (positions, head_dim)
        self._attach_kernels()

    def packed(self) -> dict:
        """The model's packed weights and shape (:attr:`PACKED`), to store and load without transformers."""
        return {name: getattr(self, name) for name in self.PACKED}

    @classmethod
    def from_packed(cls, config, packed: dict, weights: WeightFormat, dtype: torch.dtype,
                    device: torch.device) -> CompactLlama:
        """The model from what :meth:`packed` gave (for the same ``config``, ``weights`` and ``dtype``)."""
        model = cls.__new__(cls)
        model.config, model.dtype, model.device, model.weights = config, dtype, device, weights
        for name in cls.PACKED:
            setattr(model, name, packed[name])
        model._attach_kernels()
        return model

    def _attach_kernels(self) -> None:
        lib = kernels.library() if self.dtype == torch.float32 and self.device.type == "cpu" else None
        self.fused = FusedSteps(lib) if lib is not None else None
        self.native_layers = self._native_layers() if lib is not None else None
        self.intermediate = self.layers[0].down.in_features if self.layers else 0

    def _native_layers(self):
        """Every layer as the C side reads it, for decode steps run wholly in C; None unless every
        matrix's format has a C form (the int8/int4 formats)."""
        native = kernels.Layer * len(self.layers)
        layers = []
        for layer in self.layers:
            matrices = [m.native() for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(m is None for m in matrices):
                return None
            layers.append(kernels.Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *matrices))
        return native(*layers)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (every matrix once; the embedding rows are few)."""
        linear = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(m.nbytes for m in linear) + self.lm_head.nbytes

    early_exit = True  # forward(num_layers=...) runs the first layers and the head (self-drafting)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                every_position: bool = False, num_layers: int | None = None) -> torch.Tensor:
        """``input_ids`` and ``positions`` ``(batch, tokens)``; ``mask`` None (plain causal) or
        additive ``(batch, 1, tokens, kv_len)``. Returns fp32 logits ``(batch, vocab)`` of each
        row's last position, or ``(batch, tokens, vocab)`` with ``every_position``.
        ``num_layers``: run only the first layers, then the final norm and the head (an early
        exit: a self-drafting proposer's draft model); the cache gets those layers' KV only."""
        layers = self.layers[:num_layers]
        batch, tokens = input_ids.shape
        rows = batch * tokens
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        steps = self.fused if self.fused is not None and rows <= kernels.MAX_ROWS else TORCH_STEPS
        hidden = F.embedding(input_ids.reshape(rows), self.embed)  # (rows, hidden): row = (sequence, token)
        flat_positions = positions.reshape(rows)
        blocks = getattr(cache, "blocks", None) if tokens == 1 and steps is self.fused and not every_position else None
        if blocks is not None and self.native_layers is not None:  # the whole step in C
            self._native_step(hidden, flat_positions.contiguous(), blocks(), len(layers))
            return self.lm_head(steps.norm(hidden, self.norm, self.eps)).float()
        cos, sin = self.cos[flat_positions], self.sin[flat_positions]
        causal = mask is None and tokens > 1
        attend = getattr(cache, "attend", None) if tokens == 1 else None  # a decode cache's own attention
        targets = getattr(cache, "targets", None) if batch == 1 else None  # a prefill computing in place
        for index, layer in enumerate(layers):
            qkv = layer.qkv(steps.norm(hidden, layer.input_norm, self.eps))
            runs = targets(index) if targets is not None else None
            if runs is None:
                q, k = steps.rope(qkv, cos, sin, heads, kv_heads, head_dim)
                v = qkv.view(batch, tokens, heads + 2 * kv_heads, head_dim)[:, :, heads + kv_heads:].transpose(1, 2)
            else:
                q = steps.rope_into(qkv, cos, sin, heads, kv_heads, head_dim, runs)
                k, v = (runs[0][i] if len(runs) == 1 else torch.cat([run[i] for run in runs]) for i in (2, 3))
                v = v.view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
            k = k.view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
            if attend is not None:
                attn = attend(q.contiguous(), k, v, index, self.scaling).view(rows, heads * head_dim)
            else:
                keys, values = cache.update(k, v, index)
                attn = F.scaled_dot_product_attention(q.view(batch, tokens, heads, head_dim).transpose(1, 2), keys,
                                                      values, attn_mask=mask, is_causal=causal, scale=self.scaling,
                                                      enable_gqa=heads != kv_heads)
                attn = attn.transpose(1, 2).reshape(rows, heads * head_dim)
            hidden = hidden + layer.o(attn)
            hidden = hidden + layer.down(steps.silu_mul(layer.gate_up(steps.norm(hidden, layer.post_norm, self.eps))))
        if every_position:
            return self.lm_head(steps.norm(hidden, self.norm, self.eps)).float().view(batch, tokens, -1)
        last = hidden.view(batch, tokens, -1)[:, -1]
        return self.lm_head(TORCH_STEPS.norm(last, self.norm, self.eps) if steps is TORCH_STEPS
                            else steps.norm(last.contiguous(), self.norm, self.eps)).float()

    def _native_step(self, hidden: torch.Tensor, positions: torch.Tensor, blocks: kernels.CacheBlocks,
                     num_layers: int) -> None:
        """The first ``num_layers`` layers of a one-token step in one call into the kernels
        (``hidden`` in place)."""
        if int(positions.max()) >= self.cos.shape[0]:  # C reads the rotary table unchecked
            raise IndexError(f"position {int(positions.max())} is past the model's {self.cos.shape[0]} positions")
        self.fused.lib.pdflow_decode_layers(
            self.native_layers, num_layers, hidden.data_ptr(), hidden.shape[0], hidden.shape[1], self.num_heads,
            self.num_kv_heads, self.head_dim, self.intermediate, self.eps, positions.data_ptr(), self.cos.data_ptr(),
            self.sin.data_ptr(), blocks.lengths.data_ptr(), blocks.table.data_ptr(), blocks.table_width,
            blocks.block_tokens, blocks.keys, blocks.values, blocks.slot_stride, blocks.token_stride,
            blocks.head_stride, self.scaling, None if blocks.kv_keep is None else blocks.kv_keep.data_ptr(),
            torch.get_num_threads())

    __call__ = forward
