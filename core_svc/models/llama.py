"""LlamaForCausalLM and its relatives (Mistral, Qwen2, Qwen3) over a flattened batch with a paged KV cache.

The differences between the four are data (``arch.SUPPORTED_ARCHITECTURES``): q/k/v bias, o bias, per-head
q/k norm, sliding windows. Parameter names follow transformers' except that q/k/v and gate/up are fused
(``qkv_proj``, ``gate_up_proj``); ``STACKED_PARAMS`` says how checkpoint tensors fill them.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers.activations import ACT2FN

from core_svc.models.arch import ModelArchConfig
from core_svc.models.interfaces import ServedModel
from core_svc.models.layers import (
    GEMV_MAX_ROWS,
    Attention,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    fused_layer_ops,
    tied_lm_head,
)
from core_svc.models.one_call_decoder import build_one_call_decoder, lora_batches
from kernels import AttentionBackend, AttentionMetadata

# checkpoint name fragment -> (our fused parameter fragment, shard index in the fused output dimension)
STACKED_PARAMS: dict[str, tuple[str, int]] = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_index: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg.layer_attention[layer_index], backend, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            ACT2FN[cfg.hidden_act],
            cfg.mlp_bias,
            dtype,
            silu=cfg.hidden_act == "silu",
        )

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(
        self,
        ops: Any,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` through ``fused_layer_ops``' kernels, the residual stream kept apart (vLLM's layout): ``hidden``
        is the previous layer's MLP output, not yet added to ``residual`` (None in the first layer, whose input
        ``hidden`` is the stream itself). Returns (this layer's MLP output, the stream before it); the same sums
        in the same order as ``forward``."""
        if residual is None:
            residual = hidden.clone()  # added to in place below
            normed = self.input_layernorm.forward_fused(ops, hidden, None)
        else:
            normed = self.input_layernorm.forward_fused(ops, hidden, residual)
        attn = self.self_attn(rope, normed, kv_cache, metadata, ops)
        normed = self.post_attention_layernorm.forward_fused(ops, attn, residual)
        return self.mlp(normed, ops), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        """``rotary``: the RoPE table (``tables(positions)``); None: ``RotaryEmbedding`` of ``cfg`` (Qwen2-VL
        passes its M-RoPE one)."""
        super().__init__()
        # An empty weight given (the checkpoint fills it) so that nn.Embedding skips its random init: on the meta
        # device that init imports torch._dynamo, about 0.8 s of a core's start, for values never used.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        # One RoPE table shared by every layer (a buffer, not a parameter).
        self.rotary = rotary or RotaryEmbedding(
            cfg.rope_inv_freq, cfg.rope_attention_scaling, cfg.max_position_embeddings, dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # one_call_decoder's and batch_decoder's: None until built at the first decode step of few rows / of more;
        # False where it does not apply
        self._one_call_decoder: Any = None
        self._batch_decoder: Any = None
        self._lora_batches: tuple[Any, ...] = ()  # of its LoRA-wrapped projections: it runs none of their adapters
        self.one_call_decoder_enabled = True  # False: every step layer by layer (tests compare the two paths)
        self.fused_ops_enabled = True  # False: torch's operators between the products (tests and benchmarks compare)

    def one_call_decoder(self) -> Any:
        """The compiled decoder for decode-only steps of 1 to ``GEMV_MAX_ROWS`` rows on CPU
        (``one_call_decoder.build_one_call_decoder``: the per-layer path's values in one call), built on first use over
        this model's weight tensors, or None where it does not apply or ``one_call_decoder_enabled`` is False."""
        return self._decoder(batch=False)

    def batch_decoder(self) -> Any:
        """``one_call_decoder``'s counterpart for decode-only steps of more rows
        (``build_one_call_decoder(batch=True)``), or None where it does not apply (int8 multiplied by its
        dequantized weight: that module's docstring) or ``one_call_decoder_enabled`` is False."""
        return self._decoder(batch=True)

    def _decoder(self, batch: bool) -> Any:
        if not self.one_call_decoder_enabled:
            return None
        built = self._batch_decoder if batch else self._one_call_decoder
        if built is None:
            decoder = build_one_call_decoder(self, batch=batch)
            built = False if decoder is None else decoder
            if batch:
                self._batch_decoder = built
            else:
                self._one_call_decoder = built
            self._lora_batches = lora_batches(self)
        return None if built is False else built

    def weights_replaced(self) -> None:
        """Its weight tensors or projection modules were replaced (``layers.notify_weights_replaced``): the
        decoders, which hold the old ones, are built again at their next use."""
        self._one_call_decoder = self._batch_decoder = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens]; inputs_embeds (given: used instead of input_ids' embeddings)
        # [num_tokens, hidden_size] -> hidden [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.tables(positions)
        ops = fused_layer_ops(hidden) if self.fused_ops_enabled else None
        if ops is None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden = layer(rope, hidden, kv_cache, metadata)
            return self.norm(hidden)
        # a decode-only step, no adapter in it: the loop below in one compiled call
        rows = hidden.shape[0]
        decoder = self.one_call_decoder() if rows <= GEMV_MAX_ROWS else self.batch_decoder()
        one_call = decoder is not None and metadata.num_decodes == rows
        if one_call and not any(batch.active for batch in self._lora_batches):
            slots, table, lens = metadata.slot_mapping, metadata.block_table, metadata.seq_lens
            return decoder.forward(hidden.contiguous(), rope[0], rope[1], kv_caches, slots, table, lens)
        residual = None
        for layer, kv_cache in zip(cast(list[DecoderLayer], self.layers), kv_caches, strict=True):
            hidden, residual = layer.forward_fused(ops, rope, hidden, residual, kv_cache, metadata)
        return self.norm.forward_fused(ops, hidden, residual)


class LlamaForCausalLM(ServedModel):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM checkpoints."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, backend, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] of the flattened batch (``input_ids``, ``positions``:
        [num_tokens] int64); ``inputs_embeds`` [num_tokens, hidden_size], when given, replaces the token
        embeddings (multimodal models merge their items' embeddings into it)."""
        return self.model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: [num_tokens] int64 -> [num_tokens, hidden_size] (vLLM's ``embed_input_ids``)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]."""
        if self.lm_head is None:  # tied: the embedding
            return tied_lm_head(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden).float()

    def checkpoint_param_name(self, name: str) -> tuple[str, int | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard index or None); None for names to skip."""
        if "rotary_emb.inv_freq" in name:
            return None
        if not name.startswith(("model.", "lm_head.")):
            # A base model's names (Qwen3-Embedding ships Qwen3Model's: "layers.0...", no "model."), as vLLM maps
            # them for embedding models.
            name = f"model.{name}"
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the head
        return fused_param_name(name)

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Output rows of each shard of a fused parameter, in shard order."""
        return fused_shard_sizes(self.cfg, fused_name)


def fused_param_name(name: str) -> tuple[str, int | None]:
    """A decoder tensor's name in our fused layout, with its shard index (``STACKED_PARAMS``), or as it is."""
    for fragment, (fused, shard) in STACKED_PARAMS.items():
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None


def fused_shard_sizes(cfg: ModelArchConfig, fused_name: str) -> list[int]:
    """Output rows of each shard of a fused decoder parameter (``qkv_proj``: q, k, v; ``gate_up_proj``), in
    shard order."""
    if ".qkv_proj." in fused_name:
        q, kv = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
        return [q, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]
