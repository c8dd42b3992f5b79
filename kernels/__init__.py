"""Attention and KV-store kernels behind one backend interface. Imports nothing of the project's.

``get_attention_backend(name)`` returns a backend; ``torch_ref`` runs everywhere (the CPU default), CUDA
backends (flash-attn, Triton) plug in through the same ``AttentionBackend`` interface.
"""

from kernels.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
