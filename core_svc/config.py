"""The core's configuration: one frozen dataclass for the service, one for the scheduler it derives.

Defaults are vLLM's (``vllm/config/scheduler.py``, ``vllm/config/cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Device = Literal["cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
SchedulingPolicy = Literal["fcfs", "priority"]

# KV cache budget when neither num_kv_blocks nor kv_cache_memory_gib is given. The cache is allocated zeroed,
# so this much memory is touched at startup; it is capped at what max_num_seqs full-length sequences can use.
DEFAULT_KV_CACHE_MEMORY_GIB = 1.0


@dataclass(frozen=True)
class CoreConfig:
    """Everything ``splitserve core`` is started with.

    Raises:
        ValueError: from ``__post_init__``, naming the field, for any value out of range.
    """

    model: str  # local Hugging Face folder or hub id
    device: Device = "cpu"
    dtype: DType = "auto"  # auto: the checkpoint's dtype
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks including the null block; overrides kv_cache_memory_gib
    kv_cache_memory_gib: float | None = None  # KV cache budget in GiB
    max_num_seqs: int = 128  # most requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap on a step's prefill chunk
    scheduling_policy: SchedulingPolicy = "fcfs"
    seed: int = 0  # seeds the engine RNG used by unseeded random sampling
    # A step whose model runner raises fails its own requests (INTERNAL) and the core goes on; this many failed
    # steps in a row, with no successful one between, declare the core dead (UNAVAILABLE, NOT_SERVING, exit).
    max_consecutive_failed_steps: int = 3
    attention_backend: str = "auto"  # auto, cpu or torch_ref (kernels.get_attention_backend)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for; -1: no cap (vLLM's default 20)
    served_model_name: str | None = None  # the metrics' model_name label (--served-model-name); None: model

    @property
    def model_name(self) -> str:
        """The name the core reports its model by: ``served_model_name``, else ``model`` as given."""
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (the null block + one), got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_consecutive_failed_steps < 1:
            raise ValueError(
                f"max_consecutive_failed_steps must be at least 1, got {self.max_consecutive_failed_steps}"
            )
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {self.max_logprobs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "cpu", "torch_ref"):
            raise ValueError(f"attention_backend must be auto, cpu or torch_ref, got {self.attention_backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs, with max_model_len resolved against the model."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, or long prompts could never be scheduled"
            )

    @classmethod
    def from_core_config(cls, config: CoreConfig, max_model_len: int) -> SchedulerConfig:
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
        )
