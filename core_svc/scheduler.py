"""Continuous-batching scheduler with one token-budget model (vLLM v1 ``Scheduler``).

Every request has ``num_computed_tokens`` and ``num_tokens``; each step hands out
``{request_id: num_scheduled_tokens}`` under ``max_num_batched_tokens``, so prefill, chunked prefill and
decode are the same case. Running requests are served first; when the KV cache is full the scheduler
preempts by recompute (FCFS: the last running request; priority: the lowest priority, latest arrival).
Waiting requests are admitted only in steps that preempted nothing. Multimodal items are encoded under an
encoder compute budget per step and an encoder cache (``EncoderCacheManager``), as vLLM's
``_try_schedule_encoder_inputs``: a chunk that would need an item that does not fit is cut before the item.
No torch, no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core_svc.config import SchedulerConfig
from core_svc.encoder_cache_manager import EncoderCacheManager
from core_svc.errors import InvalidRequestError
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from core_svc.request import EngineCoreEventType, Request, RequestStatus
from core_svc.request_queue import create_request_queue


@dataclass
class _StepPlan:
    """What ``schedule()`` has handed out so far in one step, filled by its phases."""

    token_budget: int  # tokens still to hand out this step, under max_num_batched_tokens
    encoder_compute_budget: int  # encoder output rows still to hand out this step
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request_id -> tokens to compute
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # request_id -> ids of blocks allocated
    # this step, for each request of scheduled_running
    scheduled_running: list[Request] = field(default_factory=list)  # already running, in order (less victims)
    scheduled_new: list[Request] = field(default_factory=list)  # admitted from waiting for the first time
    scheduled_resumed: list[Request] = field(default_factory=list)  # admitted again after a preemption
    preempted: list[Request] = field(default_factory=list)  # preempted this step, in order
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # request_id -> indices into
    # its mm_features encoded this step


class Scheduler:
    """Decides which requests run each step and how many tokens each computes, then folds the sampled tokens
    back into the requests and decides which finished.

    Contract: ``schedule()`` then ``update_from_output(scheduler_output, model_runner_output)`` (or
    ``fail_step(scheduler_output, error)`` when the model runner raised), strictly alternating.
    ``finish_requests`` and ``fail_requests`` may be called between steps.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.encoder_cache_manager = EncoderCacheManager(config.encoder_cache_rows)
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # finished since the last schedule(), for the model runner
        self.finished_since_last_output: set[str] = set()  # finished since the last EngineCoreOutputs
        self.num_preemptions = 0  # since the last stats

    # --- requests in and out -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: str | list[str] | set[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (aborts). Idempotent; unknown or finished ids are ignored.

        Returns the requests that were finished by this call.
        """
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else list(dict.fromkeys(request_ids))
        finished = [self.requests[i] for i in ids if i in self.requests]
        running: set[Request] = set()
        waiting: set[Request] = set()
        for request in finished:
            (running if request.status == RequestStatus.RUNNING else waiting).add(request)
        if running:
            self.running = [r for r in self.running if r not in running]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in finished:
            request.status = status
            self._free_request(request)
        return finished

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # --- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV slots.

        Running requests first (preempting when the KV cache is full), then waiting ones, only in a step that
        preempted nothing; each scheduled request's tokens then count as computed (optimistically).
        """
        step = _StepPlan(
            token_budget=self.config.max_num_batched_tokens, encoder_compute_budget=self.config.encoder_compute_budget
        )
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        scheduler_output = self._make_scheduler_output(step)
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop checks, free finished requests, and build this step's outputs; a
        request the runner failed alone (``failed_requests``) ends as in ``fail_requests``."""
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []  # in the step's order, so block ids are the same from run to run
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            if request_id in model_runner_output.failed_requests:
                # As fail_step, for this request alone: its KV of this step is not to be found by a prefix hit.
                request.num_computed_tokens -= scheduler_output.num_scheduled_tokens[request_id]
                outputs += self.fail_requests([request_id], model_runner_output.failed_requests[request_id])
                continue
            if request.mm_features:
                self._free_encoder_inputs(request)
            if request.pooling_params is not None:
                output = self._pooling_output(request, model_runner_output.pooler_output.get(request_id))
                if output is not None:
                    outputs.append(output)
                    stopped.append(request)
                continue
            new_token_ids = model_runner_output.sampled_token_ids.get(request_id, [])
            kept: list[int] = []
            error: Exception | None = None
            for token_id in new_token_ids:
                error = self._advance_grammar(request, token_id)
                if error is not None:  # a token the constraint refuses is not part of the output
                    stopped.append(request)
                    break
                request.append_output_token_id(token_id)
                kept.append(token_id)
                if self._check_stop(request):
                    stopped.append(request)
                    break
            prompt_logprobs = model_runner_output.prompt_logprobs.get(request_id)
            if not kept and prompt_logprobs is None and error is None:
                continue  # mid-prefill: nothing to report
            logprobs = model_runner_output.logprobs.get(request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=kept,
                    new_logprobs=logprobs.slice(0, len(kept)) if logprobs is not None else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=error,
                )
            )
        if stopped:
            stopped_ids = {request.request_id for request in stopped}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            for request in stopped:
                self._free_request(request)
        return self.make_outputs(outputs)

    def _pooling_output(self, request: Request, pooled: bytes | None) -> EngineCoreOutput | None:
        """A pooling request's final output, once the runner pooled its prompt (vLLM: it finishes with
        FINISHED_STOPPED when its pooler output comes, and a partial prefill emits nothing); None mid-prefill."""
        if pooled is None:
            return None
        request.status = RequestStatus.FINISHED_STOPPED
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.status.finish_reason,
            events=request.take_events(),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            pooling_output=pooled,
        )

    def fail_step(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """Instead of ``update_from_output`` when the model runner raised ``error`` running ``scheduler_output``:
        every request of the step ends with FINISHED_ERROR and ``error``; requests not in it are untouched.

        The optimistic ``num_computed_tokens`` of ``schedule()`` is taken back first, so that ``free`` evicts the
        blocks cached at allocation for tokens this forward was to compute: nobody may hit KV never written.
        Returns the failed requests' final outputs.
        """
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.num_computed_tokens -= num_tokens
        # The runner may not hold the outputs it was to encode: nobody may find them cached.
        # From the identifiers, not the requests: one aborted since this step was scheduled is gone from
        # self.requests, yet its item must leave the cache all the same.
        self.encoder_cache_manager.evict(scheduler_output.scheduled_encoder_mm_hashes)
        return self.fail_requests(list(scheduler_output.num_scheduled_tokens), error)

    def fail_requests(self, request_ids: list[str], error: Exception) -> list[EngineCoreOutput]:
        """End requests (waiting or running) with FINISHED_ERROR and ``error``, freeing their blocks; unknown ids
        are ignored. Returns their final outputs: no new token, finish reason ERROR, the error."""
        return [
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.status.finish_reason,
                events=request.take_events(),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                error=error,
            )
            for request in self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        ]

    def make_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """A step's ``EngineCoreOutputs``: ``outputs``, the stats since the last ones, the ids finished since."""
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), finished_requests=self.take_finished_requests()
        )

    def take_finished_requests(self) -> set[str]:
        """Ids finished (any reason, aborts included) since the last call."""
        finished, self.finished_since_last_output = self.finished_since_last_output, set()
        return finished

    def make_stats(self) -> SchedulerStats:
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preemptions=self.num_preemptions,
        )
        self.num_preemptions = 0
        return stats

    # --- schedule() phases ---------------------------------------------------------------------------------

    def _schedule_running(self, step: _StepPlan) -> None:
        """Running requests, in order: each gets what it lacks (``_num_tokens_to_schedule``; none: skipped). When
        its slots do not fit, victims are preempted until they do; if it is preempted itself, the phase ends."""
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_tokens_to_schedule(request, request.num_computed_tokens, step.token_budget)
            encoder_inputs: list[int] = []
            if request.mm_features and num_new_tokens:
                encoder_inputs, num_new_tokens = self._try_schedule_encoder_inputs(
                    request, request.num_computed_tokens, num_new_tokens, step
                )
            if num_new_tokens == 0:
                req_index += 1
                continue
            new_block_ids, req_index = self._allocate_or_preempt(request, req_index, num_new_tokens, step)
            if new_block_ids is None:
                break
            self._allocate_encoder_inputs(request, encoder_inputs, step)
            step.scheduled_running.append(request)
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.new_block_ids[request.request_id] = new_block_ids
            step.token_budget -= num_new_tokens
            req_index += 1

    def _allocate_or_preempt(
        self, request: Request, req_index: int, num_new_tokens: int, step: _StepPlan
    ) -> tuple[list[int] | None, int]:
        """Slots for ``num_new_tokens`` of ``request`` (``self.running[req_index]``), preempting victims
        (``_pick_preemption_victim``) until they fit; a victim scheduled earlier this step gives its tokens back.

        Returns the new blocks' ids (None: ``request`` itself was preempted) and ``request``'s index in
        ``self.running`` once the victims left it.
        """
        while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)) is None:
            victim = self._pick_preemption_victim()
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim_index < req_index:
                req_index -= 1
            if victim in step.scheduled_running:  # refund what it was given this step
                step.scheduled_running.remove(victim)
                step.token_budget += step.num_scheduled_tokens.pop(victim.request_id)
                del step.new_block_ids[victim.request_id]
                refunded = {victim.request_id: step.scheduled_encoder_inputs.pop(victim.request_id, [])}
                step.encoder_compute_budget += sum(victim.mm_features[i].length for i in refunded[victim.request_id])
                # Never encoded: gone from the cache (a request that found them there encodes them itself).
                self.encoder_cache_manager.evict(self._encoder_identifiers(refunded))
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None, req_index
        return [b.block_id for b in new_blocks], req_index

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """Admit waiting requests in queue order while budget, ``max_num_seqs`` and free blocks last; the first
        that does not fit ends the phase (no skipping ahead). Prefix-cache hits count as computed. Skipped, and
        kept in their order (as vLLM): requests whose grammar is still compiling, and requests whose LoRA adapter
        would make more than ``max_loras`` adapters run at once."""
        skipped: list[Request] = []
        max_loras = self.config.max_loras
        running_loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                so = request.structured_output
                if so is None or not so.is_ready or so.error is not None:  # a failed one: the engine core ends it
                    skipped.append(self.waiting.pop_request())
                    continue
                request.status = RequestStatus.WAITING
            if request.lora_int_id and request.lora_int_id not in running_loras and len(running_loras) >= max_loras:
                skipped.append(self.waiting.pop_request())
                continue
            computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed_tokens
            threshold = self.config.long_prefill_token_threshold
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold  # the threshold's cut is not a chunk the check below refuses (vLLM)
            if not self.config.enable_chunked_prefill and num_new_tokens > step.token_budget:
                break  # no skipping ahead: FCFS order holds
            num_new_tokens = self._num_tokens_to_schedule(request, num_computed_tokens, step.token_budget)
            encoder_inputs: list[int] = []
            if request.mm_features and num_new_tokens:
                encoder_inputs, num_new_tokens = self._try_schedule_encoder_inputs(
                    request, num_computed_tokens, num_new_tokens, step
                )
                if num_new_tokens == 0:  # the encoder budget or cache is spent this step
                    self.encoder_cache_manager.free(request)
                    break
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                # A waiting request holds no encoder cache references (preemption drops them): give back those
                # the planning took, lest they pin rows a running request needs while this one waits for blocks.
                self.encoder_cache_manager.free(request)
                break
            self.waiting.pop_request()
            self._admit(request, num_computed_tokens, step)
            if request.lora_int_id:
                running_loras.add(request.lora_int_id)
            self._allocate_encoder_inputs(request, encoder_inputs, step)
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens
        for request in reversed(skipped):
            self.waiting.prepend_request(request)

    def _admit(self, request: Request, num_computed_tokens: int, step: _StepPlan) -> None:
        """Move a request taken off the waiting queue to running, new or resumed after a preemption."""
        self.running.append(request)
        (step.scheduled_resumed if request.status == RequestStatus.PREEMPTED else step.scheduled_new).append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        request.record_event(EngineCoreEventType.SCHEDULED)

    def _make_scheduler_output(self, step: _StepPlan) -> SchedulerOutput:
        """The step for the model runner: new requests with their whole block table, running ones with this
        step's new blocks, then resumed ones with their whole (new) block table."""
        get_block_ids = self.kv_cache_manager.get_block_ids
        return SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    request_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    sampling_params=r.sampling_params,
                    block_ids=get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    mm_features=r.mm_features,
                    lora_int_id=r.lora_int_id,
                    pooling_params=r.pooling_params,
                )
                for r in step.scheduled_new
            ],
            scheduled_cached_reqs=[
                CachedRequestData(r.request_id, step.new_block_ids[r.request_id], r.num_computed_tokens, False)
                for r in step.scheduled_running
            ]
            + [
                CachedRequestData(r.request_id, get_block_ids(r.request_id), r.num_computed_tokens, True)
                for r in step.scheduled_resumed
            ],
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted},
            scheduled_encoder_inputs=step.scheduled_encoder_inputs,
            scheduled_encoder_mm_hashes=self._encoder_identifiers(step.scheduled_encoder_inputs),
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
        )

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Optimistically count this step's tokens as computed, as vLLM's ``_update_after_schedule``; the
        finished ids went to the model runner."""
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        self.finished_req_ids = set()

    # --- multimodal items ----------------------------------------------------------------------------------

    def _try_schedule_encoder_inputs(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, step: _StepPlan
    ) -> tuple[list[int], int]:
        """Which of ``request``'s items must be encoded for tokens [num_computed_tokens, + num_new_tokens), as
        vLLM's ``Scheduler._try_schedule_encoder_inputs``: items wholly before the range are in the KV cache
        (computed, or prefix-cache hits) and need nothing; cached ones are referenced; the others are encoded if
        the step's encoder compute budget and the encoder cache hold them, and otherwise the range is cut before
        the first that does not fit (to nothing when it starts inside it; without chunked prefill, to nothing).

        Returns the indices to encode (allocated by ``_allocate_encoder_inputs`` once the KV slots fit) and the
        possibly reduced ``num_new_tokens``.
        """
        encoder_inputs: list[int] = []
        identifiers: set[str] = set()
        num_rows = 0
        budget = step.encoder_compute_budget
        end = num_computed_tokens + num_new_tokens
        for i, feature in enumerate(request.mm_features):  # sorted by offset (EngineCore checks)
            if feature.offset >= end:
                break
            if feature.offset + feature.length <= num_computed_tokens:
                continue
            if self.encoder_cache_manager.check_and_update_cache(request, i) or feature.identifier in identifiers:
                continue  # cached, or already encoded for an earlier item of this request this step
            if not self.encoder_cache_manager.can_allocate(request, i, budget, num_rows):
                num_new_tokens = max(0, feature.offset - num_computed_tokens)
                if not self.config.enable_chunked_prefill:
                    num_new_tokens = 0
                break
            encoder_inputs.append(i)
            identifiers.add(feature.identifier)
            num_rows += feature.length
            budget -= feature.length
        return encoder_inputs, num_new_tokens

    def _allocate_encoder_inputs(self, request: Request, encoder_inputs: list[int], step: _StepPlan) -> None:
        """Reserve the cache rows of the items scheduled for encoding; charge the step's encoder budget."""
        for i in encoder_inputs:
            self.encoder_cache_manager.allocate(request, i)
            step.encoder_compute_budget -= request.mm_features[i].length
        if encoder_inputs:
            step.scheduled_encoder_inputs[request.request_id] = encoder_inputs

    def _free_encoder_inputs(self, request: Request) -> None:
        """Drop ``request``'s references to items whose placeholders are all computed (vLLM frees an item once
        the request's computed tokens pass it); an identifier repeated in the prompt once every use is passed."""
        num_computed = request.num_computed_tokens
        needed = {f.identifier for f in request.mm_features if f.offset + f.length > num_computed}
        for i in self.encoder_cache_manager.get_cached_input_ids(request):
            if request.mm_features[i].identifier not in needed:
                self.encoder_cache_manager.free_encoder_input(request, i)

    def _encoder_identifiers(self, encoder_inputs: dict[str, list[int]]) -> list[str]:
        """Identifiers of ``{request_id: item indices}``, all of requests in ``self.requests``."""
        return [
            self.requests[request_id].mm_features[i].identifier
            for request_id, indices in encoder_inputs.items()
            for i in indices
        ]

    # --- helpers -------------------------------------------------------------------------------------------

    def _num_tokens_to_schedule(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Tokens to compute for ``request`` this step: what it lacks, capped by the long-prefill threshold, the
        budget, and max_model_len (leaving room for the token this step samples)."""
        num_new_tokens = request.num_tokens - num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return max(0, min(num_new_tokens, token_budget, self.config.max_model_len - 1 - num_computed_tokens))

    def _pick_preemption_victim(self) -> Request:
        """FCFS: the last running request; priority: the lowest priority (largest value), latest arrival."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV blocks (cached content stays reusable) and requeue first."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _check_stop(self, request: Request) -> bool:
        """Stop checks after one appended token, in vLLM's order: EOS (unless ignore_eos), stop token ids (both
        only once min_tokens outputs exist), then length (max_tokens or max_model_len). Sets the status."""
        if request.status == RequestStatus.FINISHED_STOPPED:  # its grammar terminated
            return True
        params = request.generation_params
        last_token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token_id == params.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last_token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token_id
                return True
        if request.num_tokens >= self.config.max_model_len or request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _advance_grammar(self, request: Request, token_id: int) -> Exception | None:
        """Feed a sampled token to the request's grammar matcher, before it joins the output: a matcher that
        terminates (a stop token accepted where the grammar is complete) ends the request with FINISHED_STOPPED.
        A token the grammar refuses means the mask let none through: another setting forbade every token the
        grammar allowed (min_tokens or ignore_eos the EOS that alone completes it, allowed_token_ids the rest).
        The request then ends with FINISHED_ERROR (vLLM's rule) and an ``InvalidRequestError`` naming the
        conflict, and the token is left out. Returns the error, if any."""
        so = request.structured_output
        if so is None:
            return None
        grammar = so.grammar
        if not grammar.accept_token(token_id):
            request.status = RequestStatus.FINISHED_ERROR
            return _grammar_conflict(request)
        if grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
        return None

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self.finished_since_last_output.add(request.request_id)


def _grammar_conflict(request: Request) -> InvalidRequestError:
    """The error of a request whose other sampling settings forbade every token its constraint allowed."""
    params = request.generation_params
    num_output_tokens = request.num_output_tokens
    if num_output_tokens < params.min_tokens:
        field, setting = "min_tokens", f"min_tokens={params.min_tokens} forbids ending the output"
    elif params.allowed_token_ids:
        field, setting = "allowed_token_ids", "allowed_token_ids forbids all of them"
    else:
        field, setting = "sampling_params", "the other sampling settings (logit_bias, bad words) forbid all of them"
    return InvalidRequestError(
        field,
        f"conflicts with the structured_outputs constraint: after {num_output_tokens} output token(s) the "
        f"constraint allows only tokens that {setting}",
    )
