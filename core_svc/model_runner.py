"""Runs the model on one step's flattened batch and samples (vLLM v1 ``GPUModelRunner``), on any device.

All scheduled tokens of all requests (prefill chunks and decodes together) go through one forward with
``positions``, ``slot_mapping``, ``block_table``, ``query_start_loc`` and ``seq_lens``, which live in persistent
buffers filled on the host and copied without blocking (``core_svc.input_buffers``); logits are computed only
for rows that sample (and for prompt positions of requests that asked for prompt logprobs). Sampling runs on the
device; the step's one host sync is the transfer of the sampled ids (with the logprobs, when asked). Decode-only
steps replay CUDA graphs when they were captured (``core_svc.cuda_graphs``).

Multimodal models (vLLM's ``GPUModelRunner._execute_mm_encoder`` / ``_gather_mm_embeddings``): the items the
scheduler lists in ``scheduled_encoder_inputs`` are encoded (``embed_multimodal``) into ``encoder_cache``, keyed
by identifier; for every scheduled chunk the slice of each overlapping item's embedding is scattered into the
token embeddings at its placeholder rows, and the forward takes those ``inputs_embeds``. A step without
placeholder rows runs as for a text model.

M-RoPE models (``uses_mrope``, Qwen2-VL; vLLM's ``GPUModelRunner._calc_mrope_positions``): a request's prompt
positions ``[3, P]`` and ``mrope_position_delta`` are computed once, when it is first scheduled, and kept in its
state (through preemption); each step's chunk takes its columns of them, and tokens past the prompt (decodes, a
recompute after preemption) ``index + delta`` in all three streams. They fill the persistent
``mrope_positions`` buffer ``[3, max_num_batched_tokens]``, which the decode graphs are captured on too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from core_svc import pooler
from core_svc.cuda_graphs import DecodeGraphs, GraphCapturer, cuda_graph_capture_sizes
from core_svc.device import zeros_in_huge_pages
from core_svc.errors import EngineStepError, EngineUnavailableError
from core_svc.input_batch import NO_SAMPLING, CachedRequestState, build_sampling_metadata
from core_svc.input_buffers import BufferLimits, InputBuffers
from core_svc.lora.layers import LoRABatch
from core_svc.lora.manager import LoRAManager
from core_svc.model_loader import LoadedModel
from core_svc.models.interfaces import ServedModel, SupportsMultiModal
from core_svc.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from core_svc.request import MultiModalFeature
from core_svc.sampler import LogprobsTensors, Sampler, SamplerOutput, argmax, gather_logprobs
from core_svc.sampling_params import SamplingParams
from core_svc.structured_output import GrammarOutput, apply_grammar_bitmask
from kernels import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """The runner's limits (the scheduler never exceeds them) and its RNG seed."""

    block_size: int  # tokens per KV block
    max_num_seqs: int  # most requests in a step
    max_num_batched_tokens: int  # most tokens in a step
    max_model_len: int  # most tokens of a request
    seed: int = 0  # seeds the generator of unseeded random sampling
    kv_cache_dtype: torch.dtype | None = None  # the KV cache tensors' dtype; None: the model's

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(self.max_model_len // -self.block_size)


@dataclass
class StepInputs:
    """One forward's inputs, and which hidden rows feed the sampler and prompt logprobs."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64; [3, num_tokens] for an M-RoPE model
    metadata: AttentionMetadata
    states: list[CachedRequestState]  # the step's requests in row order (their rows: query_start_loc_cpu)
    sample_states: list[CachedRequestState]  # requests that sample this step, in row order
    sample_rows: torch.Tensor  # [num_sampling_reqs] int64, hidden row of each one's last token
    prompt_logprob_rows: dict[str, tuple[int, int, int]]  # request_id -> (first hidden row, first position, count)
    pooling_rows: list[tuple[CachedRequestState, int, int]]  # pooling requests: (state, first hidden row, count)
    graph_size: int | None = None  # the captured decode size this step replays (padded); None: eager


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors, the persistent input buffers and per-request state.

    The KV cache is allocated by ``initialize_kv_cache`` (after ``profile_run`` has measured what a step needs,
    on CUDA); decode graphs by ``capture_decode_graphs``.

    Args:
        loaded: the model from ``model_loader.load_model``, on its device.
        config: block size, the scheduler's limits, the seed.
    """

    def __init__(self, loaded: LoadedModel, config: RunnerConfig) -> None:
        self._model: ServedModel | None = loaded.model  # None while discarded (sleep level 2)
        self.arch = loaded.arch
        self.config = config
        self.vocab_size = loaded.arch.vocab_size
        self.block_size = config.block_size
        param = next(loaded.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache_dtype = config.kv_cache_dtype or self.dtype
        self.kv_caches: list[torch.Tensor] = []  # [2, num_kv_blocks, block_size, num_kv_heads, head_size] per layer
        self.uses_mrope = loaded.model.uses_mrope
        limits = BufferLimits(
            config.max_num_batched_tokens, config.max_num_seqs, config.max_num_blocks_per_req, self.uses_mrope
        )
        self.buffers = InputBuffers(limits, self.device)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.requests: dict[str, CachedRequestState] = {}
        self.decode_graphs: DecodeGraphs | None = None
        self.encoder_cache: dict[str, torch.Tensor] = {}  # identifier -> [length, hidden_size] item embeddings
        self.num_encoder_calls = 0  # items encoded so far
        self.lora_manager: LoRAManager | None = None  # set_lora: adapters are served
        self.lora_batch = LoRABatch()

    def set_lora(self, lora_manager: LoRAManager, lora_batch: LoRABatch) -> None:
        """Serve LoRA adapters: ``lora_batch`` is the one the model's ``LoRALinear`` projections read."""
        self.lora_manager, self.lora_batch = lora_manager, lora_batch

    @property
    def model(self) -> ServedModel:
        """The model on its device.

        Raises:
            EngineUnavailableError: its weights were discarded (sleep level 2) and not reloaded yet.
        """
        if self._model is None:
            raise EngineUnavailableError("the engine core is sleeping: its weights are discarded (sleep level 2)")
        return self._model

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache tensors now allocated (0 while released)."""
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def weights_bytes(self) -> int:
        """Bytes of the model's tensors: parameters, buffers and the weights its layers hold in their own layout
        (oneDNN-prepacked linear weights, dense copies); memory that several tensors view (a tied weight, a
        ``Linear``'s ``dense_weight`` over its own weight) once; 0 while discarded."""
        if self._model is None:
            return 0
        tensors = [*self._model.parameters(), *self._model.buffers()]
        for module in self._model.modules():
            tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        by_memory: dict[object, int] = {}
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's opaque layout has no storage to share
                by_memory[id(t)] = t.numel() * t.element_size()
            else:
                storage = t.untyped_storage()
                by_memory[(storage.data_ptr(), storage.device)] = storage.nbytes()
        return sum(by_memory.values())

    def release_kv_cache(self) -> int:
        """Drop the KV cache tensors (and the decode graphs, which read them); returns the bytes released.
        ``initialize_kv_cache`` allocates them again, zeroed."""
        num_bytes = self.kv_cache_bytes
        self.kv_caches = []
        self.decode_graphs = None
        return num_bytes

    def offload_weights(self) -> int:
        """Sleep level 1: move the weights (parameters and buffers) to host memory, returning the bytes moved off
        the device; on CPU they are in host memory already and stay where they are (0). The decode graphs, which
        read them where they were, are dropped."""
        if self.device.type == "cpu":
            return 0
        num_bytes = self.weights_bytes()
        self.model.to("cpu")
        self.decode_graphs = None
        return num_bytes

    def onload_weights(self) -> None:
        """Wake-up after ``offload_weights``: the weights back on the device (a no-op on CPU)."""
        if self.device.type != "cpu":
            self.model.to(self.device)

    def discard_weights(self) -> int:
        """Sleep level 2: drop the model (its weights, buffers and the encoder outputs computed with it) and the
        decode graphs; returns the bytes of weights released. ``set_model`` puts a reloaded one in place."""
        num_bytes = self.weights_bytes()
        self._model = None
        self.decode_graphs = None
        self.encoder_cache.clear()
        return num_bytes

    def set_model(self, model: ServedModel) -> None:
        """The reloaded model after ``discard_weights`` (same checkpoint, dtype, quantization and device)."""
        self._model = model

    def initialize_kv_cache(self, num_kv_blocks: int) -> bool:
        """Allocate ``num_kv_blocks`` blocks (the null block 0 included) per layer, zeroed so the null block,
        which pads block tables, never holds NaN; on CPU in transparent huge pages where Linux allows
        (``core_svc.device.zeros_in_huge_pages``). Returns whether they were asked for."""
        shape = (2, num_kv_blocks, self.block_size, self.arch.num_key_value_heads, self.arch.head_size)
        if self.device.type != "cpu":
            self.kv_caches = [
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                for _ in range(self.arch.num_hidden_layers)
            ]
            return False
        caches = [zeros_in_huge_pages(shape, self.kv_cache_dtype) for _ in range(self.arch.num_hidden_layers)]
        self.kv_caches = [cache for cache, _ in caches]
        return all(advised for _, advised in caches)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step, for measuring its peak memory (vLLM's ``GPUModelRunner.profile_run``): a forward
        of ``max_num_batched_tokens`` tokens (capped at ``max_num_seqs`` requests of ``max_model_len``) as
        ``min(tokens, max_num_seqs)`` prefills of equal length (vLLM's ``_dummy_run``), then the logits and the
        sampler, with top-k and top-p (its sort is the sampler's peak), on one row per request. Every token's
        KV goes to slot 0; without a KV cache yet, a one-block cache stands in. A multimodal model first encodes
        as many largest items as one step's encoder budget holds (vLLM's ``_dummy_encoder_run`` /
        ``profile_run``), kept alive through the forward as the encoder cache would be."""
        config = self.config
        encoder_outputs = self._profile_encoder()
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
        num_reqs = max(min(num_tokens, config.max_num_seqs), -(num_tokens // -config.max_model_len))
        lengths = [num_tokens // num_reqs] * num_reqs
        lengths[-1] += num_tokens % num_reqs
        kv_caches = self.kv_caches
        if not kv_caches:
            shape = (2, 1, self.block_size, self.arch.num_key_value_heads, self.arch.head_size)
            kv_caches = [
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                for _ in range(self.arch.num_hidden_layers)
            ]
        buffers = self.buffers
        starts = np.cumsum([0, *lengths])
        buffers.input_ids.np[:num_tokens] = 0
        buffers.positions.np[:num_tokens] = np.concatenate([np.arange(n) for n in lengths])
        if buffers.mrope_positions is not None:
            buffers.mrope_positions.np[:, :num_tokens] = buffers.positions.np[:num_tokens]
        buffers.slot_mapping.np[:num_tokens] = 0
        buffers.query_start_loc.np[: num_reqs + 1] = starts
        buffers.seq_lens.np[:num_reqs] = lengths
        buffers.clear_block_table(0, 0)
        buffers.block_table.np[:num_reqs] = 0
        buffers.sample_rows.np[:num_reqs] = starts[1:] - 1
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping.copy_to_device(num_tokens),
            query_start_loc=buffers.query_start_loc.copy_to_device(num_reqs + 1),
            seq_lens=buffers.seq_lens.copy_to_device(num_reqs),
            block_table=buffers.block_table.copy_to_device(num_reqs),
            query_start_loc_cpu=starts.tolist(),
            seq_lens_cpu=lengths,
            max_query_len=max(lengths),
            max_seq_len=max(lengths),
            num_decodes=sum(1 for n in lengths if n == 1),
        )
        input_ids = buffers.input_ids.copy_to_device(num_tokens)
        hidden = self.model(input_ids, self._copy_positions(num_tokens), kv_caches, metadata)
        logits = self.model.compute_logits(hidden[buffers.sample_rows.copy_to_device(num_reqs)])
        params = SamplingParams(temperature=1.0, top_k=self.vocab_size - 1, top_p=0.99)
        states = [CachedRequestState(f"profile-{i}", [0], params, None, [], 0) for i in range(num_reqs)]
        self.sampler(logits, build_sampling_metadata(states, self.vocab_size, self.device))
        del encoder_outputs
        _synchronize(self.device)

    def _profile_encoder(self) -> list[torch.Tensor]:
        """The profile run's encoder part: ``encoder_compute_budget // max_tokens_per_mm_item`` dummy items in one
        batch (at least one); none for a text model."""
        if not isinstance(self.model, SupportsMultiModal):
            return []
        item_rows = self.model.max_tokens_per_mm_item
        budget = max(self.config.max_num_batched_tokens, item_rows)  # SchedulerConfig.encoder_compute_budget
        return self.model.embed_multimodal_batch([self.model.dummy_mm_feature()] * (budget // item_rows))

    def capture_decode_graphs(self, capturer: GraphCapturer) -> None:
        """Capture decode graphs at ``cuda_graph_capture_sizes`` (after ``initialize_kv_cache``); from then on
        decode-only steps that fit replay them. ``CudaGraphCapturer`` on CUDA; ``EagerCapturer`` in CPU tests.

        Raises:
            RuntimeError: the KV cache is not allocated yet.
        """
        if not self.kv_caches:
            raise RuntimeError("capture_decode_graphs needs the KV cache: call initialize_kv_cache first")
        graphs = DecodeGraphs(cuda_graph_capture_sizes(self.config.max_num_seqs, self.config.max_num_batched_tokens))
        with torch.inference_mode():
            graphs.capture(self._decode_graph_forward, capturer)
        self.decode_graphs = graphs

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Forward the scheduled tokens, sample for requests whose known tokens are all computed; the rows of
        ``grammar_output`` (structured outputs) are masked by their grammar bitmask before sampling."""
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output)
        failed: dict[str, Exception] = {}
        try:
            self._set_lora_batch(inputs)
            inputs_embeds = None
            if isinstance(self.model, SupportsMultiModal):
                self._execute_mm_encoder(scheduler_output)
                inputs_embeds = self._gather_mm_embeddings(scheduler_output, inputs, failed)
            if inputs_embeds is not None:  # eager: graphs embed ids themselves (padded rows included here)
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, inputs_embeds)
            elif inputs.graph_size is not None and self.decode_graphs is not None and not self.lora_batch.active:
                # (Graphs are captured without adapters: a step that uses one runs eagerly, its pad rows too.)
                hidden = self.decode_graphs.replay(inputs.graph_size)  # [graph_size, hidden]: rows past the step pad
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
            prompt_logprobs = self._compute_prompt_logprobs(hidden, inputs)
            pooled = self._pool(hidden, inputs)
            sampler_output = None
            if inputs.sample_states:
                logits = self.model.compute_logits(hidden[inputs.sample_rows])
                if grammar_output is not None:
                    sample_ids = [state.request_id for state in inputs.sample_states]
                    apply_grammar_bitmask(logits, sample_ids, grammar_output)
                sampler_output = self._sample(logits, inputs.sample_states)
        except BaseException:
            self.lora_batch.segments = []
            # The step's non-blocking copies may still be reading the pinned host buffers, which the next step
            # rewrites: let them finish before the failure leaves (the step that succeeds waits in _make_output).
            _synchronize(self.device)
            raise
        self.lora_batch.segments = []
        output = self._make_output(scheduler_output, inputs, sampler_output, prompt_logprobs, pooled)
        output.failed_requests = failed
        return output

    def _set_lora_batch(self, inputs: StepInputs) -> None:
        """The step's adapter segments (``LoRABatch``): each adapter the step's requests use gets a slot
        (``LoRAManager.activate``), and each run of consecutive requests under one adapter (``_prepare_inputs``
        orders them so) one segment of token rows; none when no request uses an adapter."""
        if self.lora_manager is None:
            return
        runs: list[tuple[int, int, int]] = []  # (lora_int_id, start row, end row)
        query_start_loc = inputs.metadata.query_start_loc_cpu
        for i, state in enumerate(inputs.states):
            if not state.lora_int_id:
                continue
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if runs and runs[-1][0] == state.lora_int_id and runs[-1][2] == start:
                runs[-1] = (state.lora_int_id, runs[-1][1], end)
            else:
                runs.append((state.lora_int_id, start, end))
        if not runs:
            self.lora_batch.segments = []
            return
        slots = self.lora_manager.activate({int_id for int_id, _, _ in runs})
        self.lora_batch.segments = [(slots[int_id], start, end) for int_id, start, end in runs]

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Fold each pooling request's rows of ``hidden`` ``[num_tokens, hidden_size]`` (the final norm's output)
        into its accumulators (``core_svc.pooler``); returns the vectors ``[dimensions]`` float32 of those whose
        prompt this step completes, on the device."""
        pooled: dict[str, torch.Tensor] = {}
        for state, row, count in inputs.pooling_rows:
            pooler.accumulate(state, hidden[row : row + count], state.num_computed_tokens)
            if state.num_computed_tokens + count >= state.num_prompt_tokens:
                pooled[state.request_id] = pooler.finish(state, hidden[row + count - 1])
        return pooled

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState]) -> SamplerOutput:
        """One token per row of ``logits`` ``[len(states), vocab_size]``. When every row samples by argmax
        (``samples_by_argmax``: a greedy batch without logprobs, logits processors or penalties, e.g. one chat
        request), the sampler would only take the argmax: take it without building the sampler's per-row tensors."""
        if all(state.samples_by_argmax for state in states):
            return SamplerOutput(sampled_token_ids=argmax(logits), logprobs=None)
        return self.sampler(logits, build_sampling_metadata(states, self.vocab_size, self.device))

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request state of ``request_ids``; unknown ids are ignored."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> None:
        """Encode the items the scheduler scheduled, in one batch, and keep them in ``encoder_cache`` (vLLM's
        ``_execute_mm_encoder``); an item another request already had encoded is not encoded again."""
        pending: dict[str, MultiModalFeature] = {}
        for request_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            features = self.requests[request_id].mm_features
            for i in input_ids:
                if features[i].identifier not in self.encoder_cache:
                    pending.setdefault(features[i].identifier, features[i])
        if pending:
            outputs = self._encode(list(pending.values()))
            self.encoder_cache.update(zip(pending, outputs, strict=True))

    def _encode(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """[feature.length, hidden_size] embeddings of each item."""
        if not isinstance(self.model, SupportsMultiModal):
            raise TypeError(f"{type(self.model).__name__} takes no multimodal items")
        self.num_encoder_calls += len(features)
        return self.model.embed_multimodal_batch(features)

    def _gather_mm_embeddings(
        self, scheduler_output: SchedulerOutput, inputs: StepInputs, failed: dict[str, Exception]
    ) -> torch.Tensor | None:
        """Token embeddings [num_tokens, hidden_size] (padded rows included) with each scheduled chunk's
        placeholder rows replaced by the exact slice of its items' embeddings (vLLM's ``_gather_mm_embeddings``:
        a chunk may start or end inside an item). None when the step has no placeholder row.

        A request with an item whose embeddings are not ``length`` rows goes into ``failed`` (request_id -> why)
        and keeps its token embeddings: it alone fails, not the step."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        query_start_loc = inputs.metadata.query_start_loc_cpu
        for i, state in enumerate(inputs.states):
            if not state.mm_features:
                continue
            start = state.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[state.request_id]
            for feature in state.mm_features:
                item_end = feature.offset + feature.length
                if feature.offset >= end:
                    break
                if item_end <= start:
                    continue
                lo, hi = max(start, feature.offset), min(end, item_end)
                embeddings = self.encoder_cache.get(feature.identifier)
                if embeddings is None:  # a scheduling plan undone by a preemption this step: encode, uncached
                    [embeddings] = self._encode([feature])
                if embeddings.shape[0] != feature.length:
                    failed[state.request_id] = EngineStepError(
                        "the engine core failed while running this request: the multimodal item at offset "
                        f"{feature.offset} has {embeddings.shape[0]} embedding rows for {feature.length} "
                        "placeholder tokens"
                    )
                    continue
                parts.append(embeddings[lo - feature.offset : hi - feature.offset])
                first_row = query_start_loc[i] + lo - start
                rows.extend(range(first_row, first_row + hi - lo))
        if not parts:
            return None
        inputs_embeds = self.model.embed_input_ids(inputs.input_ids)
        index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        inputs_embeds[index] = torch.cat(parts).to(inputs_embeds.dtype)
        return inputs_embeds

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.remove_requests(scheduler_output.finished_req_ids)
        for identifier in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params or NO_SAMPLING  # a pooling request never samples
            generator = None
            if params.seed is not None and not params.is_greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                mm_features=list(new.mm_features),
                lora_int_id=new.lora_int_id,
                pooling_params=new.pooling_params,
            )
            if self.uses_mrope:  # now, while the items carry their data (image_grid_thw)
                positions, delta = self.model.get_mrope_input_positions(len(new.prompt_token_ids), new.mm_features)
                state = self.requests[new.request_id]
                state.mrope_positions, state.mrope_position_delta = positions.numpy(), delta
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
                state.prompt_logprobs_parts.clear()
                state.pooling_sum = state.pooling_first = None  # its prompt is computed again
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Fill the host buffers, pad a decode-only step to its graph's size, copy to the device."""
        block_size, buffers = self.block_size, self.buffers
        # Requests with one query token first: attention backends batch them as decodes (vLLM's reorder_batch);
        # with LoRA, by adapter within each, so that each adapter's rows are one segment (LoRABatch).
        if self.lora_manager is None:
            scheduled = sorted(scheduler_output.num_scheduled_tokens.items(), key=lambda item: item[1] != 1)
        else:
            requests = self.requests
            scheduled = sorted(
                scheduler_output.num_scheduled_tokens.items(),
                key=lambda item: (item[1] != 1, requests[item[0]].lora_int_id),
            )
        num_decodes = sum(1 for _, num_tokens in scheduled if num_tokens == 1)
        num_reqs = len(scheduled)
        states = [self.requests[request_id] for request_id, _ in scheduled]
        buffers.clear_block_table(num_reqs, max(len(state.block_ids) for state in states))
        block_table, input_ids = buffers.block_table.np, buffers.input_ids.np
        positions, slot_mapping = buffers.positions.np, buffers.slot_mapping.np
        mrope_positions = buffers.mrope_positions.np if buffers.mrope_positions is not None else None
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_states: list[CachedRequestState] = []
        sample_rows: list[int] = []
        prompt_logprob_rows: dict[str, tuple[int, int, int]] = {}
        pooling_rows: list[tuple[CachedRequestState, int, int]] = []
        for i, (state, (request_id, num_tokens)) in enumerate(zip(states, scheduled, strict=True)):
            start, row = state.num_computed_tokens, query_start_loc[-1]
            end = start + num_tokens
            block_ids = state.block_ids
            block_table[i, : len(block_ids)] = block_ids
            if num_tokens == 1:  # a decode: plain Python beats numpy for one token
                positions[row] = start
                slot_mapping[row] = block_ids[start // block_size] * block_size + start % block_size
                input_ids[row] = state.token_ids[start]
            else:
                token_positions = np.arange(start, end, dtype=np.int64)
                positions[row : row + num_tokens] = token_positions
                blocks = block_table[i, token_positions // block_size].astype(np.int64)
                slot_mapping[row : row + num_tokens] = blocks * block_size + token_positions % block_size
                input_ids[row : row + num_tokens] = state.token_ids[start:end]
            if mrope_positions is not None:
                _fill_mrope_positions(mrope_positions[:, row : row + num_tokens], state, start, end)
            if state.wants_prompt_logprobs and start < state.num_prompt_tokens - 1:
                count = min(end, state.num_prompt_tokens - 1) - start
                prompt_logprob_rows[request_id] = (row, start, count)
            query_start_loc.append(row + num_tokens)
            seq_lens.append(end)
            if state.pooling_params is not None:
                pooling_rows.append((state, row, num_tokens))
            elif end >= len(state.token_ids):
                sample_states.append(state)
                sample_rows.append(row + num_tokens - 1)
        buffers.query_start_loc.np[: num_reqs + 1] = query_start_loc
        buffers.seq_lens.np[:num_reqs] = seq_lens
        buffers.sample_rows.np[: len(sample_rows)] = sample_rows
        graph_size = None
        if self.decode_graphs is not None and num_decodes == num_reqs:
            graph_size = self.decode_graphs.padded_size(num_reqs)
        num_rows = num_reqs if graph_size is None else graph_size  # requests (= tokens for decodes) copied
        num_tokens = query_start_loc[-1] if graph_size is None else graph_size
        if graph_size is not None:
            buffers.pad_decode_rows(num_reqs, graph_size)
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping.copy_to_device(num_tokens),
            query_start_loc=buffers.query_start_loc.copy_to_device(num_rows + 1),
            seq_lens=buffers.seq_lens.copy_to_device(num_rows),
            block_table=buffers.block_table.copy_to_device(num_rows),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
        )
        return StepInputs(
            input_ids=buffers.input_ids.copy_to_device(num_tokens),
            positions=self._copy_positions(num_tokens),
            metadata=metadata,
            states=states,
            sample_states=sample_states,
            sample_rows=buffers.sample_rows.copy_to_device(len(sample_rows)),
            prompt_logprob_rows=prompt_logprob_rows,
            pooling_rows=pooling_rows,
            graph_size=graph_size,
        )

    def _decode_graph_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """Static inputs of the ``size`` decode graph, all pad rows for now, and its forward on them.

        The metadata holds slices of the persistent device buffers, which each replayed step refills. Its
        Python fields hold values valid for any replay: ``seq_lens_cpu`` and ``max_seq_len`` are
        ``max_model_len``, ``num_decodes`` is ``size``; a graph-safe backend must not read them (they are not
        the step's), and one that does (``torch_ref``) then covers every row's whole block table and masks by the
        ``seq_lens`` tensor."""
        buffers = self.buffers
        buffers.query_start_loc.np[0] = 0
        buffers.pad_decode_rows(0, size)
        max_model_len = self.config.max_model_len
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping.copy_to_device(size),
            query_start_loc=buffers.query_start_loc.copy_to_device(size + 1),
            seq_lens=buffers.seq_lens.copy_to_device(size),
            block_table=buffers.block_table.copy_to_device(size),
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[max_model_len] * size,
            max_query_len=1,
            max_seq_len=max_model_len,
            num_decodes=size,
        )
        input_ids = buffers.input_ids.copy_to_device(size)
        positions = self._copy_positions(size)  # M-RoPE: the [3, size] columns of its buffer

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, metadata)

        return forward

    def _copy_positions(self, num_tokens: int) -> torch.Tensor:
        """The step's positions on the device: ``[num_tokens]``, or ``[3, num_tokens]`` for an M-RoPE model."""
        if self.buffers.mrope_positions is not None:
            return self.buffers.mrope_positions.copy_columns_to_device(num_tokens)
        return self.buffers.positions.copy_to_device(num_tokens)

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, LogprobsTensors]:
        """Logprobs of this step's prompt tokens 1..P-1 given their prefixes, on the device, per request."""
        parts: dict[str, LogprobsTensors] = {}
        pin = self.device.type == "cuda"
        for request_id, (row, first_position, count) in inputs.prompt_logprob_rows.items():
            state = self.requests[request_id]
            logprobs = self.model.compute_logits(hidden[row : row + count]).log_softmax(dim=-1)
            targets = torch.tensor(
                state.prompt_token_ids[first_position + 1 : first_position + 1 + count], pin_memory=pin
            ).to(self.device, non_blocking=True)
            k = state.sampling_params.prompt_logprobs or 0  # set: rows are made for wants_prompt_logprobs only
            k = self.vocab_size if k == -1 else k
            parts[request_id] = gather_logprobs(logprobs, targets, k, [k] * count)
        return parts

    def _make_output(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        sampler_output: SamplerOutput | None,
        prompt_logprobs: dict[str, LogprobsTensors],
        pooled: dict[str, torch.Tensor],
    ) -> ModelRunnerOutput:
        """The step's one device-to-host transfer (sampled ids, logprobs, prompt logprobs, pooled vectors;
        copies started together, one sync), then the per-request bookkeeping on the host."""
        sampled_host = logprobs_host = None
        if sampler_output is not None:
            sampled_host = sampler_output.sampled_token_ids.to("cpu", non_blocking=True)
            if sampler_output.logprobs is not None:
                logprobs_host = sampler_output.logprobs.to_host()
        prompt_host = {request_id: part.to_host() for request_id, part in prompt_logprobs.items()}
        pooled_host = {request_id: vector.to("cpu", non_blocking=True) for request_id, vector in pooled.items()}
        _synchronize(self.device)
        output = ModelRunnerOutput(sampled_token_ids={rid: [] for rid in scheduler_output.num_scheduled_tokens})
        # float32 little-endian: the wire's EngineCoreOutput.pooling_output (x86 and ARM hosts are little-endian)
        output.pooler_output = {rid: vector.numpy().astype("<f4").tobytes() for rid, vector in pooled_host.items()}
        for request_id, part in prompt_host.items():
            self.requests[request_id].prompt_logprobs_parts.append(part.tolists())
        for state in inputs.sample_states:  # a request whose prefill completes emits its prompt logprobs
            if state.wants_prompt_logprobs:
                parts = state.prompt_logprobs_parts
                output.prompt_logprobs[state.request_id] = LogprobsLists(
                    logprob_token_ids=[ids for part in parts for ids in part.logprob_token_ids],
                    logprobs=[values for part in parts for values in part.logprobs],
                    ranks=[rank for part in parts for rank in part.ranks],
                )
                parts.clear()
        if sampled_host is None:
            return output
        logprobs = logprobs_host.tolists() if logprobs_host is not None else None
        for i, (state, token_id) in enumerate(zip(inputs.sample_states, sampled_host.tolist(), strict=True)):
            state.token_ids.append(token_id)
            output.sampled_token_ids[state.request_id] = [token_id]
            if logprobs is not None and state.sampling_params.logprobs is not None:
                output.logprobs[state.request_id] = logprobs.slice(i, i + 1)
        return output


def _fill_mrope_positions(out: np.ndarray, state: CachedRequestState, start: int, end: int) -> None:
    """Write the M-RoPE positions of ``state``'s tokens ``start..end-1`` into ``out`` ``[3, end - start]``: its
    prompt positions where they reach, ``index + delta`` past the prompt (``mrope.mrope_positions``)."""
    prompt_positions = state.mrope_positions
    if prompt_positions is None:
        raise RuntimeError(f"request {state.request_id} has no M-RoPE positions")
    prompt_len = prompt_positions.shape[1]
    split = min(max(start, prompt_len), end)  # first index past the prompt
    out[:, : split - start] = prompt_positions[:, start:split]
    out[:, split - start :] = np.arange(split, end) + state.mrope_position_delta


def _synchronize(device: torch.device) -> None:
    """Wait for the device's current stream (the non-blocking copies to the host land by then); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
