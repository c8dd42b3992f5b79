"""vLLM's engine arguments (``LLM(...)``, ``EngineArgs``) as the Python API's engine settings: those with a
splitserve equivalent are renamed to it, those that set nothing here are taken at their neutral values (a vLLM
script passing ``tensor_parallel_size=1`` or ``trust_remote_code=True`` runs as it is), and any other value of
theirs is refused naming the argument and why, rather than ignored. Everything else goes to the core's
``CoreConfig`` as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values) or value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == 0


def _any(value: Any) -> bool:
    return True


# name -> (whether a value sets nothing here, why other values are refused)
_NO_EFFECT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tensor_parallel_size": (_is(1), "a model runs on one device (start a core per device instead)"),
    "pipeline_parallel_size": (_is(1), "a model runs on one device"),
    "data_parallel_size": (_is(1), "start one core per device and give the frontend their addresses"),
    "trust_remote_code": (_any, ""),  # only splitserve's own model code runs, whatever the value
    "disable_log_stats": (_any, ""),  # the offline LLM logs no periodic stats
    "enable_sleep_mode": (_any, ""),  # sleep mode is always available
    "async_scheduling": (_any, ""),  # a scheduling overlap of GPU engines; results are the same
    "max_seq_len_to_capture": (_any, ""),  # CUDA graphs cover decode batches of any length here
    "swap_space": (_any, ""),  # preempted requests are recomputed, as in vLLM v1, never swapped
    "disable_custom_all_reduce": (_any, ""),
    "cpu_offload_gb": (_empty, "weights are not offloaded to host memory"),
    "tokenizer_mode": (_is("auto", "hf"), "tokenizers load with transformers' AutoTokenizer"),
    "skip_tokenizer_init": (_is(False), "the frontend needs the tokenizer (detokenization, stop strings)"),
    "revision": (_is(), "give a local folder, or a hub id at its default revision"),
    "tokenizer_revision": (_is(), "give a local tokenizer folder"),
    "code_revision": (_is(), "only splitserve's own model code runs"),
    "download_dir": (_is(), "hub models go to huggingface_hub's cache (HF_HOME)"),
    "hf_token": (_is(), "set HF_TOKEN in the environment; huggingface_hub reads it"),
    "hf_overrides": (_empty, "config.json is read as it is"),
    "config_format": (_is("auto", "hf"), "config.json is read with transformers"),
    "load_format": (_is("auto", "safetensors"), "weights load from safetensors files"),
    "model_impl": (_is("auto", "vllm"), "splitserve runs its own model code"),
    "compilation_config": (_empty, "no model graph is compiled (torch.compile)"),
    "distributed_executor_backend": (_is("mp", "uni"), "a model runs in one process"),
    "mm_processor_kwargs": (_empty, "images are processed with the model's processor settings"),
    "pooler_config": (_is(), "pooling follows the checkpoint's sentence-transformers files or each request"),
    "logits_processors": (_empty, "custom logits processors are not supported"),
    "structured_outputs_config": (_empty, "structured outputs run with xgrammar"),
    "attention_config": (_empty, "the attention backend is attention_backend"),
    "override_generation_config": (_empty, "use generation_config (a folder holding a generation_config.json)"),
    "enable_prompt_embeds": (_is(False), "prompts as embeddings are not supported"),
    "task": (_is("auto", "generate"), "use runner='pooling' for an embedding model"),
    "kv_transfer_config": (_is(), "disaggregated prefill is not supported"),
}
# vLLM's name -> splitserve's, with the value converted
_RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "num_gpu_blocks_override": ("num_kv_blocks", lambda blocks: blocks),
    "kv_cache_memory_bytes": ("kv_cache_memory_gib", lambda size: size / 2**30),
}


def engine_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (the Python API's engine settings, vLLM's names among them) as splitserve's: vLLM's arguments
    that set nothing here dropped, renamed ones renamed (a None value dropped).

    Raises:
        ValueError: a vLLM argument at a value splitserve cannot honour, naming it and why.
    """
    settings: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in _NO_EFFECT:
            neutral, why = _NO_EFFECT[name]
            if not neutral(value):
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        elif name in _RENAMED:
            if value is not None:
                ours, convert = _RENAMED[name]
                settings[ours] = convert(value)
        else:
            settings[name] = value
    return settings
