"""The core's configuration: one frozen dataclass for the service, one for the scheduler it derives.

Defaults are vLLM's (``vllm/config/scheduler.py``, ``vllm/config/cache.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from splitserve.base import cpu_threads
from splitserve.base.config_args import NOT_A_FLAG, flag
from splitserve.base.mm_limits import DEFAULT_LIMIT_PER_PROMPT, image_limit, parse_limit_mm_per_prompt

Device = Literal["cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's ModelDType names of the same dtypes
# vLLM's --kv-cache-dtype names (its fp8 ones are not served), and float32: a float32 model's own dtype by name, the
# way to keep it under int8 weights, where auto is bfloat16 (core_svc.engine_core.kv_cache_dtype_for)
KVCacheDType = Literal["auto", "float32", "bfloat16"]
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
Quantization = Literal["int8"]  # core_svc.models.quantization
QUANTIZATION_METHODS = ("int8",)
SchedulingPolicy = Literal["fcfs", "priority"]
Runner = Literal["generate", "pooling"]  # vLLM's --runner
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
AttentionBackendName = Literal["auto", "cpu", "torch_ref", "triton", "flash_attn"]  # kernels.get_attention_backend
ATTENTION_BACKEND_NAMES = ("auto", "cpu", "torch_ref", "triton", "flash_attn")

# KV cache budget when neither num_kv_blocks nor kv_cache_memory_gib is given. The cache is allocated zeroed,
# so this much memory is touched at startup; it is capped at what max_num_seqs full-length sequences can use.
DEFAULT_KV_CACHE_MEMORY_GIB = 1.0


@dataclass(frozen=True)
class CoreConfig:
    """Everything ``splitserve core`` is started with; its flags (``splitserve core``, ``serve``, ``generate``) are
    generated from these fields (``splitserve.base.config_args``).

    Raises:
        ValueError: from ``__post_init__``, naming the field, for any value out of range.
    """

    # MODEL or --model on the command line, resolved against $SPLITSERVE_MODEL and the demo model there.
    model: str = field(metadata=NOT_A_FLAG)  # local Hugging Face folder or hub id
    device: Device = field(default="cpu", metadata=flag("where the model runs"))
    dtype: DType = field(default="auto", metadata=flag("the weights' and activations' dtype; auto: the checkpoint's"))
    # vLLM's --kv-cache-dtype: auto stores keys and values in the model's dtype, except under --quantization int8,
    # where a float32 model's cache is bfloat16 (as llama.cpp's cache is 16-bit whatever its weights): the float32
    # cache's attention is about half of an int8 decode step, and bfloat16's rounding moves logprobs far less than
    # int8 weights do (docs/benchmarks.md, "int8's KV cache bfloat16 by default"). bfloat16 under a float32 model
    # halves the KV cache's bytes per token (twice the tokens in the same budget) and what each decode step's
    # attention reads, rounding every key and value once to bfloat16 (the cpu and torch_ref attention backends;
    # measured in docs/benchmarks.md, "Column-major float32 weights, and a bfloat16 KV cache").
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata=flag(
            "the KV cache's dtype; auto: the model's, but bfloat16 under --quantization int8; bfloat16 halves a "
            "float32 model's KV memory; float32 keeps a float32 model's cache under int8"
        ),
    )
    # vLLM's --quantization: int8 weights per output channel, quantized at load from the float checkpoint; batches
    # quantize the activations per row too (W8A8: core_svc.models.quantization). Under it a float32 model's KV cache
    # is bfloat16 unless --kv-cache-dtype float32 (above).
    quantization: Quantization | None = field(
        default=None,
        metadata=flag(
            "int8: linear weights int8 per output channel, batches' activations int8 per row, the KV cache "
            "bfloat16 (CPU only)",
            default_help="none: the weights in --dtype",
        ),
    )
    # CPU float32 or bfloat16 without quantization (ignored otherwise): linear weights kept dense beside their
    # batch layout (panels, column-major or oneDNN-packed), and steps of few rows (one request's decode) use the
    # dense ones through the compiled matrix-vector kernel (at most GEMV_MAX_ROWS rows; nothing is kept where the
    # build has no kernel for the dtype); the kept weights take twice their memory
    # (core_svc.models.layers.prepack_linear_weights says which are kept; docs/benchmarks.md).
    dense_decode_weights: bool = field(
        default=False,
        metadata=flag(
            "CPU float32 and bfloat16: keep dense linear weights beside their batch layout for few-row (one-request) "
            "decode steps through the compiled matrix-vector kernel (twice those weights' memory; bfloat16 on an AMX "
            "CPU is dense already)"
        ),
    )
    block_size: int = field(default=16, metadata=flag("tokens per KV block", unit="tokens"))
    # KV blocks including the null block; overrides kv_cache_memory_gib.
    num_kv_blocks: int | None = field(
        default=None,
        metadata=flag(
            "KV cache size in blocks, the null block included",
            default_help="from --kv-cache-memory-gib",
            exclusive="kv_cache_size",
        ),
    )
    kv_cache_memory_gib: float | None = field(
        default=None,
        metadata=flag(
            "KV cache budget in GiB",
            default_help=f"{DEFAULT_KV_CACHE_MEMORY_GIB:g} GiB, capped at what --max-num-seqs full sequences use",
            exclusive="kv_cache_size",
        ),
    )
    max_num_seqs: int = field(default=128, metadata=flag("most requests running at once", unit="requests"))
    max_num_batched_tokens: int = field(
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metadata=flag(
            "token budget of one step (left at the default with chunked prefill off: max_model_len, as vLLM's)",
            unit="tokens",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag("tokens per sequence, prompt and output", default_help="the model's max_position_embeddings"),
    )
    enable_prefix_caching: bool = field(default=True, metadata=flag("turn automatic prefix caching off"))
    enable_chunked_prefill: bool = field(
        default=True, metadata=flag("turn chunked prefill off (a prompt's prefill then takes one step)")
    )
    long_prefill_token_threshold: int = field(
        default=0, metadata=flag("most prompt tokens of a request per step; 0: no cap", unit="tokens")
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata=flag("fcfs: first come, first served; priority: lowest priority value first"),
    )
    seed: int = field(default=0, metadata=flag("seed of the engine RNG (unseeded random sampling)"))
    # vLLM's --runner (with --convert embed implied for pooling): a decoder model served as an embedding model.
    runner: Runner = field(
        default="generate",
        metadata=flag(
            "generate: generation requests, and pooling (embedding) requests beside them; pooling: an embedding "
            "model, pooling requests only (generation refused), pooled as the folder's sentence-transformers "
            "modules.json says, else LAST with normalize"
        ),
    )
    # A step whose model runner raises fails its own requests (INTERNAL) and the core goes on; this many failed
    # steps in a row, with no successful one between, declare the core dead (UNAVAILABLE, NOT_SERVING, exit).
    max_consecutive_failed_steps: int = field(
        default=3,
        metadata=flag(
            "failed model steps in a row (no successful one between) that declare the core dead", unit="steps"
        ),
    )
    attention_backend: AttentionBackendName = field(
        default="auto",
        metadata=flag(
            "auto: on CPU the compiled CPU kernel when it builds, else torch_ref; on CUDA flash_attn when the "
            "flash-attn package imports and fits the dtype and block size, else triton"
        ),
    )
    # vLLM's --gpu-memory-utilization: the KV cache gets what is left of this share of the GPU's memory after the
    # weights and a profile run of the largest step. Ignored on CPU (--kv-cache-memory-gib sizes it there).
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=flag("share of the GPU's memory the core may use: weights, activations and KV cache (CUDA only)"),
    )
    # vLLM's --enforce-eager: no CUDA graphs; every step runs eagerly.
    enforce_eager: bool = field(default=False, metadata=flag("never capture CUDA graphs: every step runs eagerly"))
    # Most logprobs / prompt_logprobs a request may ask for (vLLM's default 20).
    max_logprobs: int = field(default=20, metadata=flag("cap on logprobs per request; -1: no cap"))
    # The compute threads (torch.set_num_threads); None: the cores this process may use, from its CPU affinity and
    # cgroup quota (splitserve.base.cpu_threads), or OMP_NUM_THREADS when set.
    num_threads: int | None = field(
        default=None,
        metadata=flag(
            "CPU threads for the model's compute",
            default_help="OMP_NUM_THREADS, else the cores this process may use (CPU affinity and cgroup quota)",
            metavar="N",
        ),
    )
    # vLLM's VLLM_CPU_OMP_THREADS_BIND: nobind, auto, all or a CPU list (0-3,6); None: the variable
    # SPLITSERVE_CPU_OMP_THREADS_BIND, default nobind (splitserve.base.cpu_threads).
    cpu_omp_threads_bind: str | None = field(
        default=None,
        metadata=flag(
            "pin the core to these CPUs with one OpenMP thread on each: a CPU list (0-3,6), auto (the cores it may "
            "use), all (its affinity mask), or nobind",
            default_help="$SPLITSERVE_CPU_OMP_THREADS_BIND, else nobind",
            metavar="CPUS",
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=flag(
            "the name the model is reported by: the metrics' model_name label",
            default_help="the model as given",
            metavar="NAME",
        ),
    )

    # vLLM's --limit-mm-per-prompt, an engine argument there too: the core refuses a request with more items, and
    # without --max-receive-message-mib sizes its gRPC receive limit for at most that many of its model's largest
    # images (fewer when the prompt's max_model_len - 1 tokens hold fewer: ``request_size``). The help is shared
    # by core and generate (which has no receive limit), so it names no server flag.
    limit_mm_per_prompt: str | None = field(
        default=None,
        metadata=flag(
            'the most images one request may hold, as vLLM\'s flag: image=N (or JSON {"image": N}); more are '
            "refused with INVALID_ARGUMENT; a core server also tells it to its frontends and sizes its default "
            "receive limit by it (docs/operations.md)",
            default_help=f"image={DEFAULT_LIMIT_PER_PROMPT}, vLLM's",
            metavar="image=N",
        ),
    )

    # LoRA adapters (vLLM's engine arguments of the same names and defaults).
    enable_lora: bool = field(
        default=False, metadata=flag("serve LoRA adapters: AddLora / RemoveLora / ListLoras and per-request adapters")
    )
    max_loras: int = field(default=1, metadata=flag("most LoRA adapters used in one step (device slots)"))
    max_lora_rank: int = field(default=16, metadata=flag("highest LoRA rank an adapter may have"))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=flag(
            "most LoRA adapters whose weights stay in host memory while no request uses them; beyond it the least "
            "recently used one's are dropped and read again from its folder when a request names it (it stays "
            "loaded)",
            default_help="--max-loras",
            metavar="N",
        ),
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "LoRA adapters to load at startup, as name=path (PEFT folders) or vLLM's JSON form "
            '{"name": ..., "path": ..., "base_model_name": ...}',
            metavar="NAME=PATH",
        ),
    )

    @property
    def image_limit(self) -> int:
        """The most images one request may hold (``limit_mm_per_prompt``; 999 when unset)."""
        return image_limit(parse_limit_mm_per_prompt(self.limit_mm_per_prompt))

    @property
    def model_name(self) -> str:
        """The name the core reports its model by: ``served_model_name``, else ``model`` as given."""
        return self.served_model_name or self.model

    @property
    def lora_capacity(self) -> int:
        """Adapters whose weights stay in host memory: ``max_cpu_loras``, else ``max_loras`` (vLLM's default)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def lora_module_paths(self) -> dict[str, str]:
        """``lora_modules`` as name -> folder.

        Raises:
            ValueError: an entry that is not name=path, or a name given twice.
        """
        paths: dict[str, str] = {}
        for entry in self.lora_modules:
            if entry.lstrip().startswith("{"):  # vLLM's JSON form: {"name": ..., "path": ..., "base_model_name": ...}
                try:
                    module = json.loads(entry)
                except ValueError as e:
                    raise ValueError(f"lora_modules: {entry!r} is not JSON: {e}") from e
                fields = module if isinstance(module, dict) else {}
                name, path = fields.get("name"), fields.get("path")
                if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
                    raise ValueError(f"lora_modules: {entry!r} needs a 'name' and a 'path'")
            else:
                name, sep, path = entry.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules: {entry!r} is not name=path (nor vLLM's JSON form)")
            if name in paths:
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
            paths[name] = path
        return paths

    def __post_init__(self) -> None:
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)  # raises ValueError naming it
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))  # argparse gives a list
        # vLLM's dtype names besides the torch ones
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        self.lora_module_paths()
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
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.cpu_omp_threads_bind is not None:
            cpu_threads.check_bind(self.cpu_omp_threads_bind, "cpu_omp_threads_bind")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32 (float), bfloat16 or float16 (half), got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        # What the flags alone rule out: a float32 model's narrower cache on a backend that stores the model's dtype
        # (core_svc.engine_core.kv_cache_dtype_for checks the model's dtype as loaded, and the chosen backend).
        stores_model_dtype = self.attention_backend in ("triton", "flash_attn")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float32" and stores_model_dtype:
            raise ValueError(
                f"kv_cache_dtype bfloat16 under a float32 model needs the cpu or torch_ref attention backend; the "
                f"{self.attention_backend} backend stores keys and values in the model's dtype "
                f"(use kv_cache_dtype auto)"
            )
        if self.kv_cache_dtype == "float32" and self.dtype in ("bfloat16", "float16") and self.device == "cuda":
            # on CPU a 16-bit dtype may load as float32 (core_svc.cpu_dtype); kv_cache_dtype_for decides there
            raise ValueError(
                f"kv_cache_dtype float32 under a {self.dtype} model: a KV cache in a dtype other than the model's "
                f"is served for float32 models only (use kv_cache_dtype auto)"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), got {self.quantization!r}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs on CPU only, not on device {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_NAMES)}, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be generate or pooling, got {self.runner!r}")
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
    max_loras: int = 0  # most LoRA adapters among running requests (vLLM's --max-loras); 0: LoRA off
    max_tokens_per_mm_item: int = 0  # the model's largest multimodal item, in placeholder tokens; 0: text only
    max_num_encoder_input_tokens: int = 0  # vLLM's: encoder output rows per step; 0: max_num_batched_tokens
    encoder_cache_size: int = 0  # vLLM's: encoder cache capacity in rows; 0: the encoder compute budget

    @property
    def encoder_compute_budget(self) -> int:
        """Most encoder output rows (placeholder tokens) computed in one step (vLLM's ``compute_encoder_budget``):
        ``max_num_encoder_input_tokens``, or the largest item when that is more, so that every item fits."""
        return max(self.max_num_encoder_input_tokens or self.max_num_batched_tokens, self.max_tokens_per_mm_item)

    @property
    def encoder_cache_rows(self) -> int:
        """The encoder cache's capacity in rows: ``encoder_cache_size``, at least the largest item; as vLLM,
        the compute budget when unset."""
        return max(self.encoder_cache_size or self.encoder_compute_budget, self.max_tokens_per_mm_item)

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, or long prompts could never be scheduled"
            )

    @classmethod
    def from_core_config(
        cls, config: CoreConfig, max_model_len: int, max_tokens_per_mm_item: int = 0
    ) -> SchedulerConfig:
        return cls(
            max_tokens_per_mm_item=max_tokens_per_mm_item,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
