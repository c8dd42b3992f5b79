"""``LLMEngine``: the synchronous engine API (vLLM ``vllm/v1/engine/llm_engine.py``).

add_request -> InputProcessor -> (n > 1: ParentRequest fan-out) -> core; step -> core outputs ->
OutputProcessor -> RequestOutputs, aborting in the core what stop strings ended.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from pathlib import Path
from typing import Any

from frontend_svc.core_client import EngineCoreClient
from frontend_svc.core_client_factory import check_core_settings, make_client
from frontend_svc.engine_args import engine_settings
from frontend_svc.engine_types import EngineCoreRequest, EngineInfo, LoRARequest, ModelConfig, SchedulerStats
from frontend_svc.errors import FrontendError, NotFoundError, ValidationError
from frontend_svc.generation_config import AUTO, load_default_sampling_params
from frontend_svc.input_processor import InputProcessor, PromptType, RequestOptions, check_wire_string
from frontend_svc.mm_processor import load_mm_processor
from frontend_svc.output_processor import OutputProcessor, PoolingOutputCollector, RequestOutputCollector
from frontend_svc.outputs import PoolingRequestOutput, RequestOutput
from frontend_svc.parallel_sampling import ParentRequest
from frontend_svc.sampling_params import SamplingParams, sampling_params_with_defaults
from frontend_svc.stats import IterationStats
from frontend_svc.tokenizer import load_tokenizer
from splitserve.base.logging_config import configure_library_logging
from splitserve.base.mm_limits import parse_limit_mm_per_prompt
from splitserve.base.model_files import resolve_model_path
from splitserve.base.pooling_params import PoolingParams

logger = logging.getLogger(__name__)

# Every output of a request carries its id, from the core on each step and to the caller on each streamed message:
# a 15 MiB id made each of them 15 MiB. vLLM sets no limit; ids in use (UUIDs, OpenAI's) are tens of characters.
MAX_REQUEST_ID_CHARS = 1024


class LLMEngineBase:
    """What vLLM's two engines, LLMEngine and AsyncLLM, share: tokenizer, input and output processors, the model's
    default sampling parameters, the core client (``engine_core``), request fan-out, and release of the core when
    closed or garbage-collected. (vLLM has no such class; its ``EngineClient`` is AsyncLLM's serving protocol.)"""

    def __init__(
        self,
        model: str,
        core_address: str | None,
        tokenizer: Any,
        asyncio_mode: bool,
        core_config: dict[str, Any],
        generation_config: str = AUTO,
    ) -> None:
        configure_library_logging()  # before the core loads: its size and the KV cache's are logged at INFO
        core_config = engine_settings(core_config)  # vLLM's engine arguments as splitserve's
        # An already connected client (the servers use it).
        client: EngineCoreClient | None = core_config.pop("engine_core_client", None)
        # The most images a prompt may hold (vLLM's limit_mm_per_prompt: {"image": N} or "image=N"): the frontend
        # refuses more before processing them; an in-process core is given it too (a remote core has its own flag).
        limit_mm_per_prompt = core_config.pop("limit_mm_per_prompt", None)
        # vLLM's --stream-interval, a frontend setting (the output processor's): outputs every this many tokens
        stream_interval = core_config.pop("stream_interval", 1)
        if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        mm_limits = parse_limit_mm_per_prompt(limit_mm_per_prompt)
        check_core_settings(core_address, core_config)  # before the tokenizer loads
        # A tokenizer folder, or one already loaded (the servers load it before the core is reachable).
        loaded = tokenizer is not None and not isinstance(tokenizer, str)
        in_process = client is None and core_address is None  # only then does this process need the weights
        if in_process and limit_mm_per_prompt is not None:
            core_config["limit_mm_per_prompt"] = limit_mm_per_prompt
        model_path = resolve_model_path(model, weights=in_process) if in_process or not loaded else Path(model)
        self.tokenizer = tokenizer if loaded else load_tokenizer(tokenizer or model_path)
        # {field: value} from the model's generation config: unset request fields take them (vLLM's
        # --generation-config; "vllm" ignores them).
        self.default_sampling_params = load_default_sampling_params(model_path, generation_config)
        self.generation_config = generation_config
        self.engine_core = client or make_client(str(model_path), core_address, asyncio_mode, **core_config)
        # Releases the core's memory when this object is collected; close() runs it early. It must not hold self.
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)
        self.engine_info: EngineInfo = self.engine_core.get_engine_info()
        # The model's image processor, loaded once (None: a text-only model, whose image inputs are refused).
        mm_processor = load_mm_processor(model_path, self.tokenizer, mm_limits)
        if mm_processor is not None:
            info = self.engine_info
            logger.info(
                mm_processor.describe_limits(
                    info.max_receive_message_bytes, info.max_model_len, info.image_limit_per_prompt
                )
            )
            if info.image_limit_per_prompt is not None and info.image_limit_per_prompt != mm_processor.image_limit:
                # Requests are refused at the smaller limit (check_count); said once here, as the flags differ.
                logger.warning(
                    "images: --limit-mm-per-prompt image=%d here, image=%d on the engine core: prompts are held to "
                    "image=%d",
                    mm_processor.image_limit,
                    info.image_limit_per_prompt,
                    min(mm_processor.image_limit, info.image_limit_per_prompt),
                )
        self.input_processor = InputProcessor(self.tokenizer, self.engine_info, mm_processor)
        self.output_processor = OutputProcessor(self.tokenizer, stream_interval)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's ``model_config``: the served model, max_model_len, dtype, vocabulary size (``ModelConfig``)."""
        return ModelConfig.from_engine_info(self.engine_info)

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's default sampling parameters (its generation config) over vLLM's (vLLM
        ``LLM.get_default_sampling_params``). A default max_tokens is the params' max_tokens where a request's
        max_tokens is cut to the room left (``LLMEngine``, as vLLM's), else a cap (``default_max_tokens``) that a
        long prompt shortens rather than being refused."""
        params = sampling_params_with_defaults({}, self.default_sampling_params)
        if self.input_processor.cap_max_tokens and params.default_max_tokens is not None:
            params.max_tokens, params.default_max_tokens = params.default_max_tokens, None
        return params

    def refresh_engine_info(self) -> None:
        """Take the core's settings again (after a reconnect, the core may have restarted with others)."""
        self.engine_info = self.engine_core.get_engine_info()
        self.input_processor.info = self.engine_info

    def close(self) -> None:
        """Shut the core down and free its memory (idempotent)."""
        self._finalizer()

    def prepare_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        options: RequestOptions,
        queue: PoolingOutputCollector | None = None,
    ) -> tuple[str, EngineCoreRequest]:
        """As ``prepare_requests``, for a pooling request (never fanned out): validated, registered with the
        output processor; returns its internal id and its core request."""
        internal_id, request, prompt_text = self.process_request(request_id, prompt, params, options)
        self.output_processor.add_pooling_request(
            request.request_id,
            request_id,
            params,
            prompt_text,
            request.prompt_token_ids,
            queue=queue,
            arrival_time=request.arrival_time,
        )
        return internal_id, request

    def prepare_requests(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        options: RequestOptions,
        queue: RequestOutputCollector | None = None,
    ) -> tuple[str, list[EngineCoreRequest]]:
        """Validate, register with the output processor, and return the internal id and the core request(s) to
        send: one, or n children ``"{i}_{internal_id}"``. The internal id is ``"{request_id}-{8 hex chars}"``
        (vLLM's). Every request is registered before any is sent, so an abort by either id reaches them all;
        when the send fails, abort them in the core and ``release_failed`` them."""
        internal_id, request, prompt_text = self.process_request(request_id, prompt, params, options)
        if params.n == 1:
            return internal_id, [self.register_request(request, request_id, prompt_text, queue)]
        parent = ParentRequest(internal_id, request_id, resolved_sampling_params(request))
        return internal_id, [self.add_child(parent, request, prompt_text, i, queue) for i in range(params.n)]

    def process_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, options: RequestOptions
    ) -> tuple[str, EngineCoreRequest, str | None]:
        """Validate a request; returns its internal id, its core request (n as asked) and its prompt text.

        Raises:
            TypeError: request_id is not a str.
            ValidationError: naming the field: request_id, the prompt, a parameter.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValidationError(
                "request_id",
                f"has {len(request_id)} characters, more than the {MAX_REQUEST_ID_CHARS} allowed (it goes back with "
                "every output)",
            )
        check_wire_string(request_id, "request_id")
        internal_id = f"{request_id}-{secrets.token_hex(4)}"
        if isinstance(params, PoolingParams):
            request, prompt_text = self.input_processor.process_pooling_inputs(internal_id, prompt, params, options)
        else:
            request, prompt_text = self.input_processor.process_inputs(internal_id, prompt, params, options)
        return internal_id, request, prompt_text

    def register_request(
        self,
        request: EngineCoreRequest,
        external_req_id: str,
        prompt_text: str | None,
        queue: RequestOutputCollector | None,
    ) -> EngineCoreRequest:
        """Register an n = 1 request with the output processor; returns it."""
        self.output_processor.add_request(
            request.request_id,
            external_req_id,
            resolved_sampling_params(request),
            prompt_text,
            request.prompt_token_ids,
            queue=queue,
            arrival_time=request.arrival_time,
            lora_request=request.lora_request,
        )
        return request

    def add_child(
        self,
        parent: ParentRequest,
        request: EngineCoreRequest,
        prompt_text: str | None,
        index: int,
        queue: RequestOutputCollector | None,
    ) -> EngineCoreRequest:
        """Register child ``index`` of ``parent`` (its request: ``request``) with the output processor; returns
        the child's core request."""
        child_id, child_params = parent.get_child_info(index)
        self.output_processor.add_request(
            child_id,
            parent.external_req_id,
            child_params,
            prompt_text,
            request.prompt_token_ids,
            parent,
            index,
            queue,
            request.arrival_time,
            request.lora_request,
        )
        return EngineCoreRequest(
            child_id,
            request.prompt_token_ids,
            child_params,
            request.arrival_time,
            request.priority,
            request.cache_salt,
            request.trace_headers,
            mm_features=request.mm_features,  # each child carries its images: the core may serve children apart
            lora_request=request.lora_request,
        )

    def release_failed(self, requests: list[EngineCoreRequest]) -> None:
        """Forget requests of which some could not be added to the core (the caller aborts those added)."""
        self.output_processor.abort_requests([r.request_id for r in requests], internal=True)


def resolved_sampling_params(request: EngineCoreRequest) -> SamplingParams:
    """A generation request's resolved sampling parameters.

    Raises:
        RuntimeError: ``request`` is a pooling request (a bug: those are never registered as generation)."""
    if request.sampling_params is None:
        raise RuntimeError(f"request {request.request_id} is a pooling request")
    return request.sampling_params


class LLMEngine(LLMEngineBase):
    """Synchronous engine: the caller drives it with ``step()``.

    Args:
        model: local Hugging Face folder or hub id.
        core_address: None runs the core in-process.
        tokenizer: a tokenizer folder, or a loaded transformers tokenizer (default: the model's).
        generation_config: where default sampling parameters come from: "auto" (the model's
            generation_config.json, as vLLM's default), "vllm" (none) or a folder.
        limit_mm_per_prompt (keyword): the most images a prompt may hold, vLLM's {"image": N} or "image=N"
            (default 999, vLLM's).
        **core_config: engine-core settings (``core_svc.config.CoreConfig`` fields: max_num_seqs,
            num_kv_blocks, dtype, ...), for the in-process core; vLLM's engine arguments are taken too
            (``engine_args``: renamed, or dropped where they set nothing here).

    A ``max_tokens`` past max_model_len is cut to the room the prompt leaves, as vLLM's engine cuts it (the
    servers' ``AsyncLLM`` refuses it, as vLLM's servers do).

    Raises:
        ModelNotFoundError: ``model`` is no model folder ("no such folder: PATH", "PATH is not a model folder: no
            config.json") nor a hub id that could be fetched.
        ValueError: engine-core settings given with ``core_address`` (a remote core has its own flags); a vLLM
            engine argument at a value splitserve cannot honour (``engine_args``).
        EngineDeadError: no core at ``core_address`` took requests within ``SPLITSERVE_ENGINE_READY_TIMEOUT_S``
            seconds (default 60).
    """

    def __init__(
        self,
        model: str,
        core_address: str | None = None,
        tokenizer: Any = None,
        generation_config: str = AUTO,
        **core_config: Any,
    ) -> None:
        super().__init__(model, core_address, tokenizer, False, core_config, generation_config)
        # vLLM's offline engines cut a max_tokens past max_model_len to the room left (the servers refuse it)
        self.input_processor.cap_max_tokens = True
        self.num_preemptions = 0  # preemptions the core reported since this engine started
        self.scheduler_stats: SchedulerStats | None = None  # the latest the core reported
        # A step that failed requests raises one error per step() call; what it produced besides waits here.
        self._pending_errors: list[FrontendError] = []
        self._pending_outputs: list[RequestOutput | PoolingRequestOutput] = []

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        *,
        trace_headers: dict[str, str] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request (n > 1 fans out). Returns the internal request id. Arguments after ``arrival_time``
        are keywords, as in vLLM's ``LLMEngine.add_request``. ``lora_request``: the LoRA adapter to generate with;
        one not loaded on the core yet is loaded from its ``lora_path`` first (as vLLM loads adapters on demand).
        With ``PoolingParams`` it is a pooling request: ``step()`` returns its ``PoolingRequestOutput`` when it
        finishes.

        Raises:
            TypeError: request_id is not a str.
            ValidationError: bad prompt, parameters or request_id (the field is named), or an adapter folder the
                core cannot serve.
            RequestTooLargeError: the request can never fit the KV cache.
            NotFoundError: ``lora_request`` names an adapter the core has not loaded, without a ``lora_path``.
        """
        options = RequestOptions(arrival_time, priority, cache_salt, trace_headers, lora_request)
        if isinstance(params, PoolingParams):
            internal_id, pooling_request = self.prepare_pooling_request(request_id, prompt, params, options)
            requests = [pooling_request]
        else:
            internal_id, requests = self.prepare_requests(request_id, prompt, params, options)
        try:
            if lora_request is not None and lora_request.lora_path:
                self.engine_core.add_lora(lora_request)  # the adapter as loaded: a no-op
            self.engine_core.add_requests(requests)  # all or none: it aborts those sent if a later one fails
        except BaseException:
            self.release_failed(requests)
            raise
        return internal_id

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one core step; return the outputs it produced (per output kind; a pooling request's
        ``PoolingRequestOutput`` once, when it finishes).

        A request the core refused, failed (a failed step) or lost raises its error, as ``AsyncLLM.generate``
        does, rather than coming back as an output with finish reason "error" and no message. It is finished
        (n > 1: with its siblings) before the error is raised; ``error.request_id`` names it. When one step
        ends several requests so, or also produced outputs, the following calls raise the other errors, then
        return the outputs, before running the core again.

        Raises:
            InternalError: the core failed while running the request.
            EngineDeadError: the core stopped, was lost, or was declared dead (also from a step run on a dead core).
            ValidationError, RequestTooLargeError, NotFoundError: a core refused the request as sent.
        """
        if not self._pending_errors and not self._pending_outputs:
            outputs = self.engine_core.get_output()
            if outputs.scheduler_stats is not None:
                self.scheduler_stats = outputs.scheduler_stats
                self.num_preemptions += outputs.scheduler_stats.num_preemptions
            processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp, IterationStats())
            self.engine_core.abort_requests(processed.reqs_to_abort)
            self._pending_errors, self._pending_outputs = processed.errors, processed.request_outputs
        if self._pending_errors:
            raise self._pending_errors.pop(0)
        request_outputs, self._pending_outputs = self._pending_outputs, []
        return request_outputs

    def abort_request(self, request_ids: str | list[str], internal: bool = False) -> None:
        """Abort by the caller's ids (every n child included; their errors and outputs not yet handed out are
        dropped), or by internal ids."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if not internal:
            self._pending_errors = [e for e in self._pending_errors if e.request_id not in ids]
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in ids]
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids, internal))

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or errors and outputs of a step not yet handed out by ``step``."""
        return bool(self._pending_errors or self._pending_outputs) or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def start_profile(self, output_dir: str | None = None) -> None:
        """vLLM's ``start_profile``: torch.profiler records the core's steps until ``stop_profile``
        (``EngineCoreClient.start_profile``; a remote core needs ``--enable-admin-rpcs``)."""
        self.engine_core.start_profile(output_dir)

    def stop_profile(self) -> list[str]:
        """Stop the profile: the Chrome traces written, one per core."""
        return self.engine_core.stop_profile()

    def sleep(self, level: int = 1, drain: bool = False) -> None:
        """Put the engine core(s) to sleep (vLLM's ``LLMEngine.sleep``): level 1 drops the KV cache and the prefix
        cache and moves the weights to host memory; level 2 drops the weights too (reloaded on ``wake_up``).
        Requests in flight end with ``EngineDeadError`` (UNAVAILABLE), raised by the next ``step`` (vLLM's default
        mode "abort"); ``drain``: a core over gRPC lets them finish first (the in-process core refuses ``drain``
        while it holds requests: ``step`` them to the end first). Until ``wake_up``, new requests are refused
        with ``EngineDeadError`` ("the engine core is sleeping").

        With several cores over gRPC, it goes to every core connected at the call (one not connected then is
        skipped) and is not atomic: when one refuses (``NotSupportedError``), the others may already sleep
        (``is_sleeping`` tells; ``wake_up`` brings them back).

        Raises:
            ValidationError: ``level`` not 1 or 2 (naming ``level``); ``drain`` as above.
            NotSupportedError: a core runs without ``--enable-admin-rpcs``.
            EngineDeadError: no core is reachable.
        """
        self.engine_core.sleep(level, drain)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released (vLLM's ``wake_up``): ``tags`` None for everything, or ``["weights"]``
        and / or ``["kv_cache"]`` (the weights first). Requests are taken again once nothing sleeps.

        Raises:
            ValidationError: a tag that is neither, naming ``tags[i]``.
            NotSupportedError, EngineDeadError: as ``sleep``.
        """
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the engine core sleeps (with several cores over gRPC: any of them)."""
        return self.engine_core.is_sleeping()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter on the core (vLLM's ``LLMEngine.add_lora``): True once it is loaded (also when it
        already was, under this name and folder).

        Raises:
            ValidationError: the folder cannot be served (the reason named).
            AlreadyExistsError: the name is loaded from another folder.
            FailedPreconditionError: the core was started without ``enable_lora``.
        """
        self.engine_core.add_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int | str) -> bool:
        """Unload an adapter by name or int id (vLLM's ``remove_lora`` takes the id); requests using it finish with
        it. Returns False when no such adapter is loaded."""
        name = self._lora_name(lora_id)
        if name is None:
            return False
        try:
            self.engine_core.remove_lora(name)
        except NotFoundError:
            return False
        return True

    def list_loras(self) -> set[int]:
        """The int ids of the loaded adapters (vLLM's ``list_loras``); ``get_loras`` gives them whole."""
        return {lora.lora_int_id for lora in self.engine_core.list_loras()}

    def get_loras(self) -> list[LoRARequest]:
        """The loaded adapters: name, int id, folder."""
        return self.engine_core.list_loras()

    def _lora_name(self, lora_id: int | str) -> str | None:
        if isinstance(lora_id, str):
            return lora_id
        return next((lora.lora_name for lora in self.engine_core.list_loras() if lora.lora_int_id == lora_id), None)
