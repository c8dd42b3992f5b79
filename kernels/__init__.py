"""Attention and KV-store kernels behind one backend interface. Imports nothing of the project's.

``get_attention_backend(name)`` returns a backend: on CPU the default (``auto``) is ``cpu``, the compiled decode
kernel, and ``torch_ref`` (plain torch, runs everywhere) when that kernel cannot be built. On CUDA it is
``flash_attn`` (the optional flash-attn package) when it imports and fits the model's ``AttentionSpec``, else
``triton``: kernels written in Triton (OpenAI's Python-embedded language for GPU kernels, compiled on first launch),
one launch per layer for a whole batch of decodes and prefill chunks, safe to capture in CUDA graphs; on CPU triton
runs only in Triton's interpreter (``TRITON_INTERPRET=1``), for tests. Other backends plug in through the same
``AttentionBackend`` interface.
"""

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from kernels.attention.selector import AttentionSpec, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "get_attention_backend"]
