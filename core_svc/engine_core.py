"""The engine core: plain Python, no grpc. Owns the scheduler, the KV cache manager and the model runner.

A step reads: schedule -> execute the model -> update requests from its output -> return outputs.

When the model runner raises (forward or sampling), the step's requests end with ``EngineStepError`` (INTERNAL)
and the core goes on: their blocks are freed, the blocks cached for tokens that forward was to compute leave the
prefix cache, and the runner forgets them. Requests of the step are not retried one by one to find the culprit:
one batched forward cannot say which row failed, a retry would re-run seeded sampling and prompt logprobs that
may already have advanced, and the usual faults (device errors, out of memory) either poison every later step
or depend on the batch, not on one request. ``CoreConfig.max_consecutive_failed_steps`` failed steps in a row
mean the engine itself is broken: the core is declared dead, every other request ends with
``EngineUnavailableError`` (UNAVAILABLE), and ``step`` / ``add_request`` raise it from then on. The exception is
running out of device memory: the step's requests end with ``StepOutOfMemoryError`` (RESOURCE_EXHAUSTED, naming
the settings to lower), the allocator's cache is emptied, and the step does not count as a failed one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core_svc import gpu_memory
from core_svc.config import DEFAULT_KV_CACHE_MEMORY_GIB, DEFAULT_MAX_NUM_BATCHED_TOKENS, CoreConfig, SchedulerConfig
from core_svc.cpu_dtype import cpu_compute_dtype, cpu_flags
from core_svc.cuda_graphs import CudaGraphCapturer
from core_svc.device import check_device, keep_freed_memory, release_cached_memory, set_compute_threads
from core_svc.errors import (
    EngineStepError,
    EngineUnavailableError,
    InvalidRequestError,
    LoRADisabledError,
    LoRANotFoundError,
    ModelLoadError,
    ProfileStateError,
    RequestTooLargeError,
    StepOutOfMemoryError,
    fault_message,
)
from core_svc.kv_cache_manager import KVCacheManager, cdiv
from core_svc.lora.adapter import LoRAModel, LoRARequest, load_lora_model
from core_svc.lora.layers import LoRABatch, LoRASlots, wrap_lora_modules
from core_svc.lora.manager import LoRAManager
from core_svc.model_loader import LoadedModel, format_bytes, load_hf_config, load_model, resolve_model_path
from core_svc.model_runner import ModelRunner, RunnerConfig
from core_svc.models.arch import ModelArchConfig
from core_svc.models.interfaces import SupportsMultiModal
from core_svc.models.llama import LlamaForCausalLM, fused_shard_sizes
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput, SchedulerStats
from core_svc.request import Request, RequestStatus
from core_svc.scheduler import Scheduler
from core_svc.sleep_mode import (
    KV_CACHE_TAG,
    WEIGHTS_TAG,
    SleepResult,
    SleepState,
    WeightsState,
    check_sleep_level,
    check_wake_up_tags,
    release_host_memory,
)
from core_svc.startup import StartupTimes
from core_svc.stats import RequestStatsTracker, StatsSink
from core_svc.structured_output import StructuredOutputManager
from kernels import AttentionBackend, AttentionSpec, get_attention_backend
from splitserve.base import envs
from splitserve.base.pooling_params import PoolerConfig, load_pooler_config, pooling_params_violation
from splitserve.base.request_rules import max_tokens_violation, prompt_violation
from splitserve.base.sampling_rules import eos_and_stop_ids

logger = logging.getLogger(__name__)

# The longest an engine step waits for a compilation while every unfinished request waits for its grammar: the
# engine loop's command poll (adds, aborts) while idle, EngineLoop._apply_commands.
GRAMMAR_WAIT_S = 0.05
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_dtype_for(
    name: str, model_dtype: torch.dtype, backend: AttentionBackend, quantization: str | None = None
) -> torch.dtype:
    """The KV cache tensors' dtype for ``--kv-cache-dtype name`` under a model in ``model_dtype`` served by
    ``backend``, its linears quantized by ``quantization`` (None: not). auto is the model's dtype (vLLM's auto),
    except for a float32 model under int8 weights on a backend that stores a narrower cache: bfloat16 there, the
    16-bit cache llama.cpp keeps whatever its weights (the float32 cache's attention is about half of an int8
    decode step; docs/benchmarks.md, "int8 over a bfloat16 KV cache"); ``float32`` names the model's own dtype.

    Raises:
        ValueError: a cache dtype other than the model's under a model that is not float32, or on a backend that
            stores only the model's dtype (one without ``supports_narrow_kv_cache``: cpu and torch_ref have it).
    """
    if name == "auto":
        narrow = quantization == "int8" and model_dtype == torch.float32 and backend.supports_narrow_kv_cache
        return torch.bfloat16 if narrow else model_dtype
    if _DTYPES[name] == model_dtype:
        return model_dtype
    model = str(model_dtype).removeprefix("torch.")
    if model_dtype != torch.float32:
        raise ValueError(
            f"kv_cache_dtype {name} under a {model} model: a KV cache in a dtype other than the model's is served "
            f"for float32 models only (use kv_cache_dtype auto)"
        )
    if not backend.supports_narrow_kv_cache:
        raise ValueError(
            f"kv_cache_dtype {name} under a float32 model needs the cpu or torch_ref attention backend; the "
            f"{backend.name} backend stores keys and values in the model's dtype (use kv_cache_dtype auto)"
        )
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineLoad:
    num_running_reqs: int
    num_waiting_reqs: int
    num_free_kv_blocks: int
    num_usable_kv_blocks: int
    kv_cache_usage: float  # fraction of usable blocks in use


@dataclass(frozen=True)
class EngineInfo:
    """What a frontend needs to know about this core (``GetEngineInfo``)."""

    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # including the null block
    kv_cache_tokens: int  # usable blocks x block_size
    dtype: str
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int  # -1: no cap
    supports_lora: bool
    image_limit_per_prompt: int  # the most images one prompt may hold (--limit-mm-per-prompt image=N)
    max_loras: int = 0  # LoRA adapters one step can use (0: LoRA off)
    max_lora_rank: int = 0  # highest rank an adapter may have (0: LoRA off)


class EngineCore:
    """Loads the model, sizes the KV cache, and runs steps.

    Raises:
        DeviceUnavailableError: from the constructor, first, when the device is ``cuda`` and torch cannot use a GPU.
        ModelLoadError: from the constructor, when the checkpoint cannot be served.
        ValueError: from the constructor, when max_model_len exceeds the model's, the KV budget holds no block,
            the attention backend asked for cannot serve this model (``kernels.get_attention_backend``), a
            ``kv_cache_dtype`` the model's dtype or the backend cannot serve (``kv_cache_dtype_for``),
            ``enable_lora`` is set for a model outside the Llama family, or ``lora_modules`` without it.
        InvalidRequestError: from the constructor, an adapter of ``lora_modules`` that cannot be served.
    """

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        if config.lora_modules and not config.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        self.startup = StartupTimes()  # where the start went; logged as one line at the end
        self.device = device = check_device(config.device)  # first: without CUDA, fail before anything slow
        logger.info("%s", set_compute_threads(config.num_threads, config.cpu_omp_threads_bind))
        if device.type == "cpu":
            logger.info("%s", keep_freed_memory())
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        with self.startup.phase("model files"):
            self.model_path = resolve_model_path(config.model)  # a hub id is fetched here
        with self.startup.phase("model config"):
            hf_config = load_hf_config(self.model_path)
            arch = ModelArchConfig.from_hf_config(hf_config)  # before the kernel: the backend must fit its dtype
        if device.type == "cpu":
            dtype, warning = cpu_compute_dtype(dtype or arch.dtype, cpu_flags())
            if warning is not None:
                logger.warning("%s", warning)
        model_dtype = dtype or arch.dtype
        with self.startup.phase("kernel"):
            spec = AttentionSpec(model_dtype, config.block_size, arch.head_size)
            backend = get_attention_backend(config.attention_backend, device, envs.kernel_dir(), spec)
        self.kv_cache_dtype = kv_cache_dtype_for(config.kv_cache_dtype, model_dtype, backend, config.quantization)
        if config.kv_cache_dtype == "auto" and self.kv_cache_dtype != model_dtype:
            logger.info(
                "KV cache in %s under %s weights (--kv-cache-dtype auto; float32 keeps the model's)",
                str(self.kv_cache_dtype).removeprefix("torch."),
                config.quantization,
            )
        # Device memory before the weights: what the KV budget is measured from on CUDA.
        baseline = gpu_memory.MemorySnapshot.measure(device) if device.type == "cuda" else None
        if baseline is not None and config.num_kv_blocks is None and config.kv_cache_memory_gib is None:
            gpu_memory.check_free_memory(baseline, config.gpu_memory_utilization)
        # Sleep level 2 reloads the weights the same way: same checkpoint, dtype, quantization and device.
        self._load_model = functools.partial(
            load_model,
            self.model_path,
            hf_config,
            dtype,
            device,
            backend,
            config.quantization,
            dense_decode_weights=config.dense_decode_weights,
        )
        with self.startup.phase("weights") as phase:
            loaded = self._load_model()
            phase.note = format_bytes(loaded.weights_bytes)
        self.max_model_len = _resolve_max_model_len(config, loaded)
        if (
            not config.enable_chunked_prefill
            and config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
            and config.max_num_batched_tokens < self.max_model_len
        ):
            # vLLM's: a step's budget left at its default holds a whole prompt when prompts are not chunked
            config = self.config = dataclasses.replace(config, max_num_batched_tokens=self.max_model_len)
            logger.info("max_num_batched_tokens=%d (max_model_len: chunked prefill is off)", self.max_model_len)
        self.vocab_size = loaded.arch.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.dtype = next(loaded.model.parameters()).dtype
        self.arch = loaded.arch
        # Before the runner and the KV sizing: the adapter slots are device memory like the weights.
        self.lora_manager = self._make_lora_manager(loaded, device) if config.enable_lora else None
        self.hidden_size = loaded.arch.hidden_size
        # Unset pooling fields take it; with either runner (a generate-runner core pools too). A generate-runner
        # core starts despite a pooling config it cannot run: only the pooling requests that need it are refused.
        self.pooler_config_error: str | None = None
        try:
            self.pooler_config: PoolerConfig = load_pooler_config(self.model_path)
        except (OSError, ValueError) as e:
            if config.runner == "pooling":
                raise ModelLoadError(f"cannot read the pooling config of {self.model_path}: {e}") from e
            self.pooler_config_error = f"the model's pooling config is not supported ({e})"
            self.pooler_config = PoolerConfig(matryoshka_dimensions=None)
            logger.warning(
                "%s; generation is served, pooling requests must give pooling_type and normalize",
                self.pooler_config_error,
            )
        self.model_runner = ModelRunner(
            loaded,
            RunnerConfig(
                config.block_size,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                config.seed,
                self.kv_cache_dtype,
            ),
        )
        if self.lora_manager is not None:
            self.model_runner.set_lora(self.lora_manager, self._lora_batch)
        with self.startup.phase("KV cache") as phase:
            self.num_kv_blocks = self._num_kv_blocks(loaded, baseline)
            bytes_per_token = loaded.arch.kv_cache_bytes_per_token(self.kv_cache_dtype)
            kv_cache_bytes = self.num_kv_blocks * bytes_per_token * config.block_size
            in_huge_pages = self.model_runner.initialize_kv_cache(self.num_kv_blocks)
            phase.note = format_bytes(kv_cache_bytes) + (", in huge pages" if in_huge_pages else "")
        self.uses_decode_graphs = (
            device.type == "cuda" and not config.enforce_eager and getattr(backend, "supports_cuda_graphs", False)
        )
        if self.uses_decode_graphs:
            with self.startup.phase("CUDA graphs"):
                self.model_runner.capture_decode_graphs(CudaGraphCapturer(device))
        kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.block_size, self.max_model_len, config.enable_prefix_caching
        )
        max_tokens_per_mm_item = self.mm_model.max_tokens_per_mm_item if self.mm_model is not None else 0
        self.scheduler = Scheduler(
            SchedulerConfig.from_core_config(config, self.max_model_len, max_tokens_per_mm_item), kv_cache_manager
        )
        self.structured_output_manager = StructuredOutputManager(self.model_path, self.vocab_size, self.eos_token_ids)
        with self.startup.phase("structured outputs"):
            self.structured_output_manager.warm_up()  # the tokenizer info: not at the first constrained request
        self._profiler: torch.profiler.profile | None = None
        self._profile_dir = Path(tempfile.gettempdir())
        self._stats: RequestStatsTracker | None = None  # set by the first add_stats_sink: metrics, tracing
        self.num_consecutive_failed_steps = 0  # steps whose model runner raised, since the last one that did not
        self.dead_error: EngineUnavailableError | None = None  # set once the core is declared dead
        self._last_stats: SchedulerStats | None = None  # those of the last step that returned any
        self.sleep_state = SleepState()  # what sleep mode has released (nothing: awake)
        # Set while new requests are refused short of death: asleep, or draining to sleep.
        self.refusal: EngineUnavailableError | None = None
        self._log_kv_cache_size(kv_cache_bytes)
        for name, path in config.lora_module_paths().items():
            with self.startup.phase(f"LoRA {name}"):
                self.add_lora(LoRARequest(name, 0, path))
        logger.info("%s", self.startup.summary())

    def _make_lora_manager(self, loaded: LoadedModel, device: torch.device) -> LoRAManager:
        """Wrap the model's projections with adapter slots (``core_svc.lora.layers``).

        Raises:
            ValueError: the model is not one of the Llama family (the models LoRA serves).
        """
        config = self.config
        if not isinstance(loaded.model, LlamaForCausalLM):
            raise ValueError(
                "--enable-lora serves Llama-family models (Llama, Mistral, Qwen2, Qwen3), not "
                f"{loaded.arch.architecture}"
            )
        self._lora_batch = LoRABatch()
        sizes = {
            "qkv_proj": fused_shard_sizes(loaded.arch, ".qkv_proj."),
            "gate_up_proj": fused_shard_sizes(loaded.arch, ".gate_up_proj."),
            "o_proj": [loaded.arch.hidden_size],
            "down_proj": [loaded.arch.hidden_size],
        }
        self._lora_slice_sizes = sizes
        self._lora_slots = LoRASlots(config.max_loras, config.max_lora_rank, self.dtype, device)
        modules = wrap_lora_modules(loaded.model, sizes, self._lora_slots, self._lora_batch)
        return LoRAManager(modules, config.max_loras, config.lora_capacity)

    def add_request(self, request: Request) -> None:
        """Validate and queue a request.

        Raises:
            InvalidRequestError: empty prompt, prompt that leaves no room for one output token, prompt plus
                max_tokens over max_model_len, token id outside the vocabulary, bad sampling parameter, or a
                request id already in use.
            LoRANotFoundError: ``lora_name`` names no loaded adapter (or LoRA is off).
            InvalidRequestError: also, the adapter's weights were dropped from host memory (``--max-cpu-loras``) and
                its folder can no longer be read, or its files changed since it was loaded.
            RequestTooLargeError: the request could never fit in the KV cache.
            EngineUnavailableError: the core was declared dead.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if self.refusal is not None:
            raise self.refusal
        self._validate(request)
        if request.lora_name is not None:
            if self.lora_manager is None:
                raise LoRANotFoundError(
                    f"lora_request: adapter {request.lora_name!r} is not loaded (LoRA is off on this engine core: "
                    "--enable-lora)"
                )
            # LoRANotFoundError when not registered; reads the folder again when the cache dropped its weights.
            model = self.lora_manager.get(request.lora_name, self._loras_in_use(), self.read_lora)
            request.lora_int_id, request.lora_hash = model.lora_request.lora_int_id, model.content_hash
        if request.pooling_params is not None:
            request.pooling_params = self.pooler_config.resolve(request.pooling_params)
        params = request.sampling_params
        if params is not None and params.eos_token_id is None and self.eos_token_ids:
            # "The model's EOS", for a client that did not fold it in (our frontend does, from the same rule). A
            # copy, since n>1 children may share one params object.
            eos_token_id, stop_token_ids = eos_and_stop_ids(
                self.eos_token_ids, params.stop_token_ids, params.ignore_eos
            )
            request.sampling_params = dataclasses.replace(
                params, eos_token_id=eos_token_id, stop_token_ids=stop_token_ids
            )
        params = request.sampling_params
        if params is not None and params.min_tokens and self.eos_token_ids:
            # min_tokens masks every EOS id of the model, with ignore_eos too (vLLM's all_stop_token_ids)
            request.sampling_params = dataclasses.replace(params, model_eos_token_ids=tuple(self.eos_token_ids))
        self.structured_output_manager.grammar_init(request)  # compiles off this thread: WAITING_FOR_FSM
        self.scheduler.add_request(request)
        if self._stats is not None:
            self._stats.on_add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests as aborted and free their blocks. Unknown or finished ids are ignored."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.structured_output_manager.forget_failures(aborted)
        self._purge_loras()
        if self._stats is not None:
            scheduler = self.scheduler
            load = SchedulerStats(len(scheduler.running), len(scheduler.waiting), scheduler.kv_cache_manager.usage)
            self._stats.on_abort(aborted, load)

    def step(self) -> EngineCoreOutputs:
        """Run one engine step and return what it produced (no outputs when idle; finished ids still flow). If
        the model runner raises, the step's requests end with ``EngineStepError`` and the rest go on (see the
        module docstring); check ``dead_error`` after each step.

        Raises:
            EngineUnavailableError: the core was declared dead by an earlier step.
        """
        if self.dead_error is not None:
            raise self.dead_error
        num_compilations_seen = self.structured_output_manager.num_compilations_done
        grammar_failures = self._fail_grammar_failures()
        scheduler_output = self.scheduler.schedule()
        try:
            grammar_output = self.structured_output_manager.grammar_bitmask(self.scheduler.requests, scheduler_output)
            model_runner_output = self.model_runner.execute_model(scheduler_output, grammar_output)
        except Exception as e:
            outputs = self._fail_step(scheduler_output, e)
        else:
            self.num_consecutive_failed_steps = 0
            outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        outputs.outputs[:0] = grammar_failures
        if not scheduler_output.total_num_scheduled_tokens and any(
            request.status == RequestStatus.WAITING_FOR_FSM for request in self.scheduler.waiting
        ):
            # All wait for grammars: do not spin. Bounded, so that the loop still takes adds and aborts.
            self.structured_output_manager.wait_for_grammar(num_compilations_seen, GRAMMAR_WAIT_S)
            if not outputs.outputs and not outputs.finished_requests and outputs.scheduler_stats == self._last_stats:
                outputs.scheduler_stats = None  # nothing happened: nothing to tell the clients
                return outputs
        self._last_stats = outputs.scheduler_stats
        if outputs.finished_requests:
            self._purge_loras()
        if self._stats is not None:
            self._stats.on_step(scheduler_output.total_num_scheduled_tokens, outputs)
        return outputs

    def shutdown(self) -> None:
        """Release what runs beside the step loop: the grammar compile pool (queued compilations are cancelled,
        their requests end with ``EngineUnavailableError``). Call once the engine loop has stopped stepping."""
        self.structured_output_manager.shutdown()

    def _fail_grammar_failures(self) -> list[EngineCoreOutput]:
        """End the requests whose constraint did not compile (INVALID_ARGUMENT with xgrammar's reason). Only the
        very request that failed: one aborted while compiling may have left its id to a new request since."""
        outputs: list[EngineCoreOutput] = []
        for request, error in self.structured_output_manager.take_failed():
            if isinstance(error, Exception) and self.scheduler.requests.get(request.request_id) is request:
                outputs += self.scheduler.fail_requests([request.request_id], error)
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput, cause: Exception) -> EngineCoreOutputs:
        """The model runner raised ``cause`` running ``scheduler_output``: fail the step's requests, forget them
        in the runner; declare the core dead after too many failed steps in a row."""
        # torch.cuda.OutOfMemoryError is torch.OutOfMemoryError (any device's) from torch 2.5 on; 2.4 has only this.
        if isinstance(cause, torch.cuda.OutOfMemoryError):
            return self._fail_step_out_of_memory(scheduler_output, cause)
        self.num_consecutive_failed_steps += 1
        failed_ids = list(scheduler_output.num_scheduled_tokens)
        limit = self.config.max_consecutive_failed_steps
        logger.error(
            "the model runner failed a step of %d request(s), which end with INTERNAL (%d of %d failed steps in a "
            "row before the core is declared dead): %s",
            len(failed_ids),
            self.num_consecutive_failed_steps,
            limit,
            ", ".join(failed_ids),
            exc_info=cause,
        )
        error = EngineStepError(f"the engine core failed while running this request: {fault_message(cause)}")
        # The runner may have taken new requests in before it raised, and not yet dropped those finished before.
        self.model_runner.remove_requests([*failed_ids, *scheduler_output.finished_req_ids])
        outputs = self.scheduler.fail_step(scheduler_output, error)
        if self.num_consecutive_failed_steps >= limit:
            self.dead_error = EngineUnavailableError(
                f"the engine core is dead: {limit} steps in a row failed (the last: {fault_message(cause)})"
            )
            others = list(self.scheduler.requests)
            logger.critical("%s; ending the %d other request(s) with UNAVAILABLE", self.dead_error, len(others))
            outputs += self.scheduler.fail_requests(others, self.dead_error)
            self.model_runner.remove_requests(others)
        return self.scheduler.make_outputs(outputs)

    def _fail_step_out_of_memory(
        self, scheduler_output: SchedulerOutput, cause: torch.cuda.OutOfMemoryError
    ) -> EngineCoreOutputs:
        """The device ran out of memory running ``scheduler_output``: its requests end with
        ``StepOutOfMemoryError`` (RESOURCE_EXHAUSTED, naming the settings to lower), their blocks go back, the
        allocator's cache is emptied, and the core goes on.

        Not counted toward ``max_consecutive_failed_steps``: an out-of-memory depends on the batch (its tokens,
        its sequences' lengths), not on a broken device, and the next batches are other ones (these requests are
        gone); every later step that fits the memory succeeds. Killing the core would fail every other request
        and the restarted core would meet the same load with the same settings.
        """
        failed_ids = list(scheduler_output.num_scheduled_tokens)
        config = self.config
        settings = (
            f"lower --max-num-batched-tokens (now {config.max_num_batched_tokens}), --max-num-seqs (now "
            f"{config.max_num_seqs}) or --gpu-memory-utilization (now {config.gpu_memory_utilization}) of the core"
        )
        logger.error(
            "the device ran out of memory running a step of %d request(s) and %d tokens, which end with "
            "RESOURCE_EXHAUSTED; the core goes on (not counted as a failed step). To avoid it, %s: %s",
            len(failed_ids),
            scheduler_output.total_num_scheduled_tokens,
            settings,
            ", ".join(failed_ids),
            exc_info=cause,
        )
        error = StepOutOfMemoryError(
            f"the engine core ran out of device memory running a step of {len(failed_ids)} request(s) and "
            f"{scheduler_output.total_num_scheduled_tokens} tokens with this one; to avoid it, {settings}"
        )
        self.model_runner.remove_requests([*failed_ids, *scheduler_output.finished_req_ids])
        outputs = self.scheduler.fail_step(scheduler_output, error)
        release_cached_memory(self.device)
        return self.scheduler.make_outputs(outputs)

    @property
    def stats_tracker(self) -> RequestStatsTracker | None:
        """The per-request tracker, once a stats sink was added (None: metrics and tracing off)."""
        return self._stats

    def add_stats_sink(self, sink: StatsSink) -> None:
        """Report every request's timing and every step's stats to ``sink`` (``CoreMetrics``,
        ``RequestTracer``), for requests added from now on. Call it on the engine's thread, or before the
        engine runs."""
        if self._stats is None:
            self._stats = RequestStatsTracker()
        self._stats.sinks.append(sink)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Load a PEFT adapter folder under ``lora_request.lora_name`` (``find_lora``, else ``read_lora`` then
        ``install_lora``); returns it as loaded, with its int id. Reads files: off the engine thread, call the
        two halves (the servers do).

        Raises:
            LoRADisabledError, LoRAExistsError, InvalidRequestError: as the halves.
        """
        return self.find_lora(lora_request) or self.install_lora(self.read_lora(lora_request))

    def find_lora(self, lora_request: LoRARequest) -> LoRARequest | None:
        """The adapter already loaded under this name from this folder (adding it again is a no-op), or None.
        Any thread.

        Raises:
            LoRADisabledError: the core was started without ``enable_lora``.
            LoRAExistsError: the name is loaded from another folder.
            InvalidRequestError: an empty name.
        """
        manager = self._lora()
        if not lora_request.lora_name:
            raise InvalidRequestError("lora_request.lora_name", "must not be empty")
        return manager.find(lora_request)

    def read_lora(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check an adapter folder (``core_svc.lora.adapter.load_lora_model``), on the host. Any thread.

        Raises:
            LoRADisabledError: the core was started without ``enable_lora``.
            InvalidRequestError: naming ``lora_request.lora_path`` and why the folder cannot be served.
        """
        self._lora()
        return load_lora_model(lora_request, self.arch, self.config.max_lora_rank)

    def install_lora(self, model: LoRAModel) -> LoRARequest:
        """Register an adapter ``read_lora`` read (on the engine thread, between steps).

        Raises:
            LoRAExistsError: the name is loaded from another folder meanwhile, or the int id asked is taken.
        """
        return self._lora().add(model, self._loras_in_use())

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter: requests naming it from now on are NOT_FOUND; those running finish with it.

        Raises:
            LoRADisabledError: the core was started without ``enable_lora``.
            LoRANotFoundError: no adapter of that name is loaded.
        """
        self._lora().remove(lora_name, self._loras_in_use())

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters (every one registered, whether its weights are in host memory or not).

        Raises:
            LoRADisabledError: the core was started without ``enable_lora``.
        """
        return self._lora().list_loras()

    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise LoRADisabledError("LoRA adapters are off on this engine core (start it with --enable-lora)")
        return self.lora_manager

    def _purge_loras(self) -> None:
        """Free the adapters removed (or whose weights the cache dropped) that no request uses any more."""
        if self.lora_manager is not None and self.lora_manager.has_unloaded_held:
            self.lora_manager.purge(self._loras_in_use())

    def _loras_in_use(self) -> set[int]:
        return {r.lora_int_id for r in self.scheduler.requests.values() if r.lora_int_id}

    def reset_prefix_cache(self) -> bool:
        """Drop all prefix-cache entries. Returns False while any request holds KV blocks."""
        return self.scheduler.reset_prefix_cache()

    @property
    def mm_model(self) -> SupportsMultiModal | None:
        """The model, when it takes multimodal items (None for a text model).

        Raises:
            EngineUnavailableError: the weights are discarded (sleep level 2).
        """
        model = self.model_runner.model
        return model if isinstance(model, SupportsMultiModal) else None

    def is_sleeping(self) -> bool:
        """Whether sleep mode has released the weights or the KV cache (and not all of it is back)."""
        return self.sleep_state.is_sleeping

    def stop_admitting(self, reason: str) -> None:
        """Refuse new requests from now on with ``EngineUnavailableError(reason)`` (UNAVAILABLE), while those in
        the core go on: the drain before a ``sleep(drain=True)``. ``sleep`` keeps refusing; ``wake_up`` ends it."""
        self.refusal = EngineUnavailableError(reason)

    def sleep(self, level: int = 1) -> tuple[SleepResult, EngineCoreOutputs]:
        """Release memory until ``wake_up`` (vLLM's ``sleep``; ``core_svc.sleep_mode``). Level 1: the KV cache
        tensors and the encoder cache are freed and the prefix cache emptied (every block free, every hash
        forgotten); the weights go to host memory (on CPU they are there already and stay). Level 2: the weights
        are dropped too (reloaded from the checkpoint on wake, in the dtype and quantization the core was started
        with). A level-2 sleep after a level-1 one drops the weights it had kept; a second call of the same level
        changes nothing.

        Every request still in the core ends with ``EngineUnavailableError`` (UNAVAILABLE: a request that had
        produced nothing may go to another core) and gives its blocks back; new ones are refused with it until
        ``wake_up`` restores everything. Freed host memory goes back to the OS (``malloc_trim``).

        Returns:
            What was freed and ended, and the ended requests' outputs (for their clients).

        Raises:
            InvalidRequestError: ``level`` is not 1 or 2.
            EngineUnavailableError: the core was declared dead.
        """
        check_sleep_level(level)
        if self.dead_error is not None:
            raise self.dead_error
        self.refusal = EngineUnavailableError(
            f"the engine core is sleeping (level {level}): it takes requests again after wake_up"
        )
        in_flight = list(self.scheduler.requests.values())
        ended = [request.request_id for request in in_flight]
        outputs: list[EngineCoreOutput] = []
        if ended:
            error = EngineUnavailableError(
                f"the engine core was put to sleep (level {level}) while this request was in it; send it again "
                "once the core is awake, or to another core"
            )
            outputs = self.scheduler.fail_requests(ended, error)
            self.structured_output_manager.forget_failures(in_flight)
            self.model_runner.remove_requests(ended)
            self._purge_loras()
            logger.info("sleep: ended %d request(s) in flight with UNAVAILABLE", len(ended))
        engine_outputs = self.scheduler.make_outputs(outputs)
        if self._stats is not None and outputs:
            self._stats.on_step(0, engine_outputs)
        state = self.sleep_state
        kv_bytes = weights_bytes = 0
        # The encoder outputs go too (vLLM clears its multimodal caches at sleep): nothing references them now.
        encoder_cache_manager = self.scheduler.encoder_cache_manager
        encoder_cache_manager.evict(list(encoder_cache_manager.lengths))
        encoder_cache_manager.get_freed_mm_hashes()  # the runner's copies are dropped here, not at the next step
        self.model_runner.encoder_cache.clear()
        if not state.kv_cache_dropped:
            if not self.scheduler.reset_prefix_cache():
                raise RuntimeError("sleep: a KV block is still held after every request ended")
            kv_bytes = self.model_runner.release_kv_cache()
            state.kv_cache_dropped = True
        if level == 2 and state.weights != WeightsState.DISCARDED:
            weights_bytes = self.model_runner.discard_weights()
            state.weights = WeightsState.DISCARDED
        elif state.weights == WeightsState.ON_DEVICE:
            weights_bytes = self.model_runner.offload_weights()
            state.weights = WeightsState.KEPT if self.device.type == "cpu" else WeightsState.OFFLOADED
        state.level = max(state.level, level)
        release_cached_memory(self.device)
        release_host_memory()
        logger.info(
            "sleeping at level %d: released %s of KV cache and %s of weights%s",
            level,
            format_bytes(kv_bytes),
            format_bytes(weights_bytes),
            " (on CPU, level 1 keeps the weights where they are: host memory)"
            if state.weights == WeightsState.KEPT
            else "",
        )
        result = SleepResult(level, len(outputs), kv_bytes, weights_bytes, [o.request_id for o in outputs])
        return result, engine_outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released (vLLM's ``wake_up``): ``tags`` None or empty: everything; else
        ``"weights"`` and / or ``"kv_cache"`` (weights first; the KV cache alone while the weights are still off is
        allowed, as in vLLM). The KV cache comes back zeroed, the prefix cache empty; decode graphs are captured
        again once both are back. Requests are taken again once nothing is asleep. Tags of what is awake are
        no-ops.

        Raises:
            InvalidRequestError: a tag that is neither ``"weights"`` nor ``"kv_cache"``, naming ``tags[i]``.
            ModelLoadError: the checkpoint cannot be read again (level 2); the weights stay off.
        """
        state = self.sleep_state
        for tag in check_wake_up_tags(tags):
            if tag == WEIGHTS_TAG and state.weights != WeightsState.ON_DEVICE:
                if state.weights == WeightsState.DISCARDED:
                    model = self._load_model().model  # logs its size and time
                    if self.lora_manager is not None:
                        # The reloaded projections get adapter slots of their own: the manager's modules and slots
                        # pointed at the discarded model's, so every adapter is copied in again when next used.
                        modules = wrap_lora_modules(model, self._lora_slice_sizes, self._lora_slots, self._lora_batch)
                        self.lora_manager.replace_modules(modules)
                    self.model_runner.set_model(model)
                else:
                    self.model_runner.onload_weights()
                state.weights = WeightsState.ON_DEVICE
            elif tag == KV_CACHE_TAG and state.kv_cache_dropped:
                self.model_runner.initialize_kv_cache(self.num_kv_blocks)
                state.kv_cache_dropped = False
        if state.is_sleeping:
            logger.info("woke up %s; still asleep: %s", ", ".join(tags or []), ", ".join(state.sleeping_tags))
            return
        if self.uses_decode_graphs and self.model_runner.decode_graphs is None:
            self.model_runner.capture_decode_graphs(CudaGraphCapturer(self.device))
        state.level = 0
        self.refusal = None
        logger.info("awake: taking requests again")

    def start_profile(self, output_dir: str | None = None) -> None:
        """Record every step with torch.profiler until ``stop_profile``.

        Raises:
            ProfileStateError: a profile is already running.
        """
        if self._profiler is not None:
            raise ProfileStateError("a profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile_dir = Path(output_dir) if output_dir else Path(tempfile.gettempdir())
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def stop_profile(self) -> str:
        """Stop the profile and write it as a Chrome trace; returns the trace's path.

        Raises:
            ProfileStateError: no profile is running.
        """
        if self._profiler is None:
            raise ProfileStateError("no profile is running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._profile_dir.mkdir(parents=True, exist_ok=True)
        path = self._profile_dir / f"splitserve-core-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        profiler.export_chrome_trace(str(path))
        return str(path)

    def get_load(self) -> EngineLoad:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        return EngineLoad(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            num_free_kv_blocks=kv.num_free_blocks,
            num_usable_kv_blocks=self.num_kv_blocks - 1,
            kv_cache_usage=kv.usage,
        )

    def get_engine_info(self) -> EngineInfo:
        return EngineInfo(
            model=self.config.model,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_tokens=(self.num_kv_blocks - 1) * self.config.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_logprobs=self.config.max_logprobs,
            supports_lora=self.lora_manager is not None,
            image_limit_per_prompt=self.config.image_limit,
            max_loras=self.config.max_loras if self.lora_manager is not None else 0,
            max_lora_rank=self.config.max_lora_rank if self.lora_manager is not None else 0,
        )

    def _num_kv_blocks(self, loaded: LoadedModel, baseline: gpu_memory.MemorySnapshot | None) -> int:
        """KV blocks, the null block included: ``num_kv_blocks``, else ``kv_cache_memory_gib`` over a block's
        bytes, else on CUDA what a profile run of the largest step leaves of ``gpu_memory_utilization``
        (``core_svc.gpu_memory``; ``baseline`` was measured before the weights), else (CPU) the default budget
        capped at what max_num_seqs full sequences use.

        Raises:
            ValueError: the budget holds fewer than two blocks (the null block and one).
        """
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        bytes_per_block = loaded.arch.kv_cache_bytes_per_token(self.kv_cache_dtype) * config.block_size
        if config.kv_cache_memory_gib is not None:
            budget_bytes, source = (
                int(config.kv_cache_memory_gib * 2**30),
                f"kv_cache_memory_gib={config.kv_cache_memory_gib}",
            )
        elif baseline is not None:
            profile = gpu_memory.measure_profile_run(
                self.model_runner.device,
                self.model_runner.profile_run,
                baseline,
                config.gpu_memory_utilization,
            )
            logger.debug("memory profile: %s", profile.describe())
            budget_bytes, source = profile.available_kv_cache_bytes, profile.describe()
            logger.info("Available KV cache memory: %.2f GiB", budget_bytes / 2**30)
        else:
            budget_bytes = int(DEFAULT_KV_CACHE_MEMORY_GIB * 2**30)
            source = f"the default {DEFAULT_KV_CACHE_MEMORY_GIB:g} GiB"
            # The default budget is only a ceiling: never more than max_num_seqs full sequences need.
            budget_bytes = min(
                budget_bytes,
                (config.max_num_seqs * cdiv(self.max_model_len, config.block_size) + 1) * bytes_per_block,
            )
        num_blocks = gpu_memory.num_kv_blocks_for_budget(budget_bytes, bytes_per_block)
        if num_blocks < 2:
            raise ValueError(f"the KV cache budget ({source}) holds no KV block of {bytes_per_block} bytes")
        return num_blocks

    def _log_kv_cache_size(self, kv_cache_bytes: int) -> None:
        """vLLM's startup lines: the cache in tokens, and how many requests of max_model_len fit at once (as
        vLLM's get_max_concurrency_for_kv_cache_config: usable blocks over the blocks one such request needs);
        a WARNING instead when not even one fits."""
        info = self.get_engine_info()
        blocks_per_request = cdiv(info.max_model_len, info.block_size)
        logger.info(
            "%s KV cache size: %s tokens (%d blocks x %d tokens, %s, %s)",
            "GPU" if self.model_runner.device.type == "cuda" else "CPU",  # vLLM's words
            f"{info.kv_cache_tokens:,}",
            info.num_kv_blocks - 1,
            info.block_size,
            format_bytes(kv_cache_bytes),
            str(self.kv_cache_dtype).removeprefix("torch."),
        )
        if info.kv_cache_tokens < info.max_model_len:
            # vLLM refuses to start here; a small cache is useful on CPUs and in tests, so warn and let requests
            # that could never fit fail with RESOURCE_EXHAUSTED (ModelInfo.kv_cache_tokens tells clients).
            logger.warning(
                "the KV cache holds %s tokens, fewer than max_model_len=%s: requests needing more are refused "
                "(maximum concurrency for %s tokens per request: %.2fx)",
                f"{info.kv_cache_tokens:,}",
                f"{info.max_model_len:,}",
                f"{info.max_model_len:,}",
                (info.num_kv_blocks - 1) / blocks_per_request,
            )
        else:
            logger.info(
                "Maximum concurrency for %s tokens per request: %.2fx",
                f"{info.max_model_len:,}",
                (info.num_kv_blocks - 1) / blocks_per_request,
            )

    def _validate(self, request: Request) -> None:
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                # vLLM's words, which clients and gateways match to retry without the field
                "priority",
                f"got {request.priority} but Priority scheduling is not enabled (--scheduling-policy priority)",
            )
        prompt = request.prompt_token_ids
        pooling = request.pooling_params is not None
        violation = prompt_violation(prompt, self.max_model_len, self.vocab_size, "prompt_token_ids", pooling=pooling)
        if violation is not None:
            raise InvalidRequestError.from_violation(violation)
        self._validate_mm_features(request)
        if request.pooling_params is not None and request.sampling_params is not None:
            raise InvalidRequestError(
                "pooling_params", "a request carries sampling_params or pooling_params, not both (vLLM's rule)"
            )
        if request.pooling_params is not None:
            self._validate_pooling(request)
            return
        if self.config.runner == "pooling":
            raise InvalidRequestError(
                "sampling_params",
                "this engine core runs an embedding model (--runner pooling): it takes pooling requests only",
            )
        if request.sampling_params is None:
            raise InvalidRequestError("sampling_params", "a request needs sampling_params or pooling_params")
        request.sampling_params.validate(self.vocab_size, self.config.max_logprobs)
        max_tokens = request.sampling_params.max_tokens
        violation = max_tokens_violation(max_tokens, len(prompt), self.max_model_len)
        if violation is not None:
            raise InvalidRequestError.from_violation(violation)
        # The last token is sampled, never computed: it needs no KV slot.
        max_len = len(prompt) + max_tokens - 1
        num_usable_blocks = self.num_kv_blocks - 1
        if cdiv(max_len, self.config.block_size) > num_usable_blocks:
            raise RequestTooLargeError(
                f"request needs up to {max_len} tokens of KV cache (prompt {len(prompt)} + max_tokens "
                f"{max_tokens} - 1), more than the whole cache "
                f"holds ({num_usable_blocks * self.config.block_size} tokens)"
            )

    def _validate_pooling(self, request: Request) -> None:
        """A pooling request's parameters (``splitserve.base.pooling_params``: vLLM's rules) and that its prompt fits
        the KV cache (it holds every prompt token's KV until it finishes).

        Raises:
            InvalidRequestError: naming the field (``pooling_type``, ``dimensions``, ...).
            RequestTooLargeError: the prompt can never fit the KV cache.
        """
        params = request.pooling_params
        if params is None:
            return
        if self.pooler_config_error is not None:  # the model's defaults are unknown: each must be given
            for field, value in (("pooling_type", params.pooling_type), ("normalize", params.normalize)):
                if value is None:
                    raise InvalidRequestError(field, f"must be set: {self.pooler_config_error}")
        violation = pooling_params_violation(params) or self.pooler_config.dimensions_violation(
            params.dimensions, self.hidden_size
        )
        if violation is not None:
            raise InvalidRequestError.from_violation(violation)
        num_prompt_tokens = len(request.prompt_token_ids)
        num_usable_blocks = self.num_kv_blocks - 1
        if cdiv(num_prompt_tokens, self.config.block_size) > num_usable_blocks:
            raise RequestTooLargeError(
                f"pooling request needs {num_prompt_tokens} tokens of KV cache (its prompt), more than the whole "
                f"cache holds ({num_usable_blocks * self.config.block_size} tokens)"
            )

    def _validate_mm_features(self, request: Request) -> None:
        """The request's multimodal items against the prompt and the model: none for a text-only model; at most
        ``--limit-mm-per-prompt`` of them; each range inside the prompt, in order and not overlapping, covering
        exactly the prompt's placeholder (image) tokens; the item's data as the model takes it
        (``mm_feature_violation``); no item larger than the encoder cache.

        Raises:
            InvalidRequestError: naming ``mm_features`` (and the item's index).
        """
        features = request.mm_features
        image_token_id = self.model_runner.arch.image_token_id
        if not features and image_token_id is None:
            return
        if features and self.mm_model is None:
            raise InvalidRequestError("mm_features", f"the model {self.config.model_name!r} takes no multimodal input")
        limit = self.config.image_limit
        if len(features) > limit:
            raise InvalidRequestError(
                "mm_features",
                f"has {len(features)} images, more than the {limit} a prompt may hold "
                f"(the engine core's --limit-mm-per-prompt image={limit})",
            )
        prompt = request.prompt_token_ids
        covered = 0
        previous_end = 0
        for i, feature in enumerate(features):
            name = f"mm_features[{i}]"
            start, end = feature.offset, feature.offset + feature.length
            if feature.length < 1 or start < 0 or end > len(prompt):
                raise InvalidRequestError(
                    name, f"placeholder range [{start}, {end}) is not inside the prompt of {len(prompt)} tokens"
                )
            if start < previous_end:
                raise InvalidRequestError(
                    name,
                    f"placeholder range [{start}, {end}) overlaps or precedes the previous item's (ending at "
                    f"{previous_end}); items go in prompt order",
                )
            previous_end = end
            wrong = next((j for j in range(start, end) if prompt[j] != image_token_id), None)
            if wrong is not None:
                raise InvalidRequestError(
                    name,
                    f"prompt token {wrong} is {prompt[wrong]}, not the model's image token {image_token_id}, inside "
                    f"the placeholder range [{start}, {end})",
                )
            covered += feature.length
        num_placeholders = sum(1 for token_id in prompt if token_id == image_token_id)
        if num_placeholders != covered:
            raise InvalidRequestError(
                "mm_features",
                f"the prompt holds {num_placeholders} image tokens ({image_token_id}), the items cover {covered}",
            )
        for i, feature in enumerate(features):
            violation = self.mm_model.mm_feature_violation(feature) if self.mm_model is not None else None
            if violation is not None:
                raise InvalidRequestError(f"mm_features[{i}]", violation)


def _resolve_max_model_len(config: CoreConfig, loaded: LoadedModel) -> int:
    model_max = loaded.arch.max_position_embeddings
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {model_max}"
        )
    return config.max_model_len
