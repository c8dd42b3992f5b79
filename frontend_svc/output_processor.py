"""Turns engine-core outputs into API outputs (vLLM ``vllm/v1/engine/output_processor.py``).

One ``RequestState`` per core request: detokenizer, stop strings, logprobs, output kind. Requests a stop
string ended are returned in ``reqs_to_abort``: the core does not know they are done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.detokenizer import IncrementalDetokenizer
from frontend_svc.engine_types import EngineCoreOutput, FinishReason, LoRARequest
from frontend_svc.errors import FrontendError, InternalError, RequestAbortedError
from frontend_svc.logprobs import LogprobsProcessor
from frontend_svc.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from frontend_svc.parallel_sampling import ParentRequest
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from frontend_svc.stats import IterationStats, RequestStateStats
from splitserve.base.pooling_params import PoolingParams
from splitserve.base.status import StatusCode

# Statuses of a request refused as sent (a bad field, too large for the cache, an unknown adapter): not the
# server's failures, so not counted as finished requests.
CLIENT_ERROR_CODES = frozenset(
    {
        StatusCode.INVALID_ARGUMENT,
        StatusCode.NOT_FOUND,
        StatusCode.ALREADY_EXISTS,
        StatusCode.RESOURCE_EXHAUSTED,
        StatusCode.FAILED_PRECONDITION,
        StatusCode.UNIMPLEMENTED,
    }
)


class RequestOutputCollector:
    """Per-request mailbox between the output handler and an ``AsyncLLM.generate`` consumer. Outputs that pile
    up while the consumer is busy are merged when it takes them (``RequestOutput.merge``: DELTA outputs
    concatenated, others replaced per completion), in one pass: a put costs O(1), whatever the consumer's delay.
    An error put replaces what is pending and stays until taken. A closed collector (its consumer has gone)
    takes nothing more."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str = "") -> None:
        self.request_id = request_id  # the internal id of the request (the parent's, for n > 1)
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.closed = False
        self._pending: list[RequestOutput] = []
        self._error: Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.closed or self._error is not None:
            return
        if isinstance(output, Exception):
            self._error = output
            self._pending.clear()
        else:
            self._pending.append(output)
        self.ready.set()

    def close(self) -> None:
        """The consumer has gone: drop what is pending and take nothing more."""
        self.closed = True
        self._pending.clear()
        self._error = None

    async def get(self) -> RequestOutput:
        while not self._pending and self._error is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return self._take() if self._pending or self._error is not None else None

    def _take(self) -> RequestOutput:
        self.ready.clear()
        error, self._error = self._error, None
        if error is not None:
            raise error
        if not self._pending:
            raise RuntimeError("no output to take")
        pending, self._pending = self._pending, []
        return RequestOutput.merge(pending, self.aggregate)


class PoolingOutputCollector:
    """A pooling request's mailbox between the output handler and an ``AsyncLLM.encode`` consumer: one output
    (or an error), when the request finishes. A closed collector takes nothing more."""

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id  # the internal id of the request
        self.closed = False
        self._output: PoolingRequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: PoolingRequestOutput | Exception) -> None:
        if self.closed or self._output is not None:
            return
        self._output = output
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self._output = None

    async def get(self) -> PoolingRequestOutput:
        await self.ready.wait()
        output, self._output = self._output, None
        if isinstance(output, Exception):
            raise output
        if output is None:
            raise RuntimeError("no output to take")
        return output


class PoolingRequestState:
    """What the frontend tracks for one pooling request: no detokenizer, no logprobs; one output, at the end."""

    def __init__(
        self,
        request_id: str,
        external_req_id: str,
        params: PoolingParams,
        prompt: str | None,
        prompt_token_ids: list[int],
        queue: PoolingOutputCollector | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.external_req_id = external_req_id
        self.params = params
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.queue = queue
        self.parent: ParentRequest | None = None  # never fanned out
        self.stats = RequestStateStats(arrival_time=time.time() if arrival_time is None else arrival_time)

    def finish_stats(self, finish_reason: FinishReason, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            # max_tokens None: a pooling request has none (vLLM's max_tokens_param for it)
            iteration_stats.update_from_finished_request(
                str(finish_reason), len(self.prompt_token_ids), None, self.stats
            )

    def make_output(self, data: list[float], num_cached_tokens: int) -> PoolingRequestOutput:
        """The request's one output, with its vector ``data``."""
        return PoolingRequestOutput(
            request_id=self.external_req_id,
            outputs=PoolingOutput(data),
            prompt_token_ids=self.prompt_token_ids,
            finished=True,
            num_cached_tokens=num_cached_tokens,
            prompt=self.prompt,
            metrics=self.stats,
        )


class RequestState:
    """Everything the frontend tracks for one core request (a child, when n > 1)."""

    def __init__(
        self,
        request_id: str,
        external_req_id: str,
        params: SamplingParams,
        prompt: str | None,
        prompt_token_ids: list[int],
        tokenizer: Any | None,
        parent: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.request_id = request_id
        self.external_req_id = external_req_id
        # vLLM's stream_interval: while running, an output only for the first token and then every this many
        self.stream_interval = stream_interval
        self._tokens_at_last_output: int | None = None  # None: no output yet
        self.params = params
        self.lora_request = lora_request
        self.output_kind = params.output_kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.parent = parent
        self.request_index = request_index
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer.from_request(tokenizer, params, prompt_token_ids)
        self.logprobs = LogprobsProcessor(self.detokenizer, tokenizer, params, prompt_token_ids)
        self.num_cached_tokens = 0
        self._prompt_logprobs_sent = False
        self.stats = RequestStateStats(arrival_time=time.time() if arrival_time is None else arrival_time)

    def finish_stats(self, finish_reason: FinishReason, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            iteration_stats.update_from_finished_request(
                str(finish_reason), len(self.prompt_token_ids), self.params.max_tokens, self.stats
            )
            num_generation_tokens = self.stats.num_generation_tokens
            if self.parent is not None:
                self.parent.observe_finished_child(num_generation_tokens, iteration_stats)
            else:
                iteration_stats.n_params_iter.append(1)
                iteration_stats.max_num_generation_tokens_iter.append(num_generation_tokens)

    def make_request_output(
        self, finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> RequestOutput | None:
        """The output to send now, or None while its kind holds it back. Text, ids and logprobs are what the
        detokenizer releases: while running, ids only with their whole text (after the stop-string hold-back and
        unfinished characters); at the end, everything."""
        finished = finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        num_tokens = len(self.detokenizer.token_ids)
        if self.stream_interval > 1 and not finished and self._tokens_at_last_output is not None:
            if num_tokens - self._tokens_at_last_output < self.stream_interval:
                return None  # held: the next output carries these tokens too (DELTA) or all of them
        self._tokens_at_last_output = num_tokens
        delta = self.output_kind == RequestOutputKind.DELTA
        text, start, end = self.detokenizer.get_next_output(finished, delta)
        logprobs = self.logprobs.get_logprobs(start, end)  # builds the dicts of the ids released now
        completion = CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=self.detokenizer.token_ids[start:end],
            logprobs=logprobs,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            stop_reason=stop_reason,
        )
        if self.parent is not None:
            completions, finished = self.parent.get_outputs(self.request_id, completion)
            if not completions:
                return None
        else:
            completions = [completion]
        prompt_logprobs = self.logprobs.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # DELTA sends prompt logprobs once; the first output carries them, later ones [] (vLLM's
            # pop_prompt_logprobs: None only when they were not asked for).
            prompt_logprobs = [] if self._prompt_logprobs_sent else prompt_logprobs
            self._prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.stats,
            lora_request=self.lora_request,
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)  # for callers
    # without a queue
    reqs_to_abort: list[str] = field(default_factory=list)  # internal ids a stop string or a failed sibling ended
    # For callers without a queue: requests the core refused, failed or lost, one error each (``request_id`` set)
    errors: list[FrontendError] = field(default_factory=list)


class OutputProcessor:
    """Owns every in-flight ``RequestState``; maps external ids (and parents) to internal ids for aborts."""

    def __init__(self, tokenizer: Any | None, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        # vLLM's --stream-interval: a streamed request's outputs come every this many tokens at least (a request's
        # own stream_interval may raise it, not lower it)
        self.stream_interval = stream_interval
        self.request_states: dict[str, RequestState | PoolingRequestState] = {}
        # The caller's id -> its internal ids (children for n > 1), as an ordered set: removing one is O(1).
        self.external_req_ids: dict[str, dict[str, None]] = {}
        self.parent_requests: dict[str, ParentRequest] = {}  # internal parent id -> parent, while children run

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request_id: str,
        external_req_id: str,
        params: SamplingParams,
        prompt: str | None,
        prompt_token_ids: list[int],
        parent: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id} is already in flight")
        self.request_states[request_id] = RequestState(
            request_id,
            external_req_id,
            params,
            prompt,
            prompt_token_ids,
            self.tokenizer,
            parent,
            request_index,
            queue,
            arrival_time,
            lora_request,
            max(self.stream_interval, params.stream_interval or 1),
        )
        self.external_req_ids.setdefault(external_req_id, {})[request_id] = None
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def add_pooling_request(
        self,
        request_id: str,
        external_req_id: str,
        params: PoolingParams,
        prompt: str | None,
        prompt_token_ids: list[int],
        queue: PoolingOutputCollector | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Track a pooling request (vLLM's ``OutputProcessor`` keeps it with no detokenizer)."""
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id} is already in flight")
        self.request_states[request_id] = PoolingRequestState(
            request_id, external_req_id, params, prompt, prompt_token_ids, queue, arrival_time
        )
        self.external_req_ids.setdefault(external_req_id, {})[request_id] = None

    def process_outputs(
        self,
        engine_core_outputs: Iterable[EngineCoreOutput],
        engine_core_timestamp: float = 0.0,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        """Detokenize, match stop strings and build outputs. A request the core ended with an error fails with
        it, n > 1 siblings included: its queue gets the error, or, without a queue, ``errors``. With
        ``iteration_stats``, also record each request's timing (``engine_core_timestamp``: the core's
        ``EngineCoreOutputs.timestamp``) and what finished."""
        result = OutputProcessorOutput()
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted while the output was on its way
            if iteration_stats is not None:
                iteration_stats.update_from_output(
                    len(output.new_token_ids),
                    output.events,
                    engine_core_timestamp,
                    len(state.prompt_token_ids),
                    state.stats,
                )
            if output.error is not None:
                error = output.error
                result.reqs_to_abort.extend(self._fail(state, error, iteration_stats))
                if state.queue is None:
                    result.errors.append(error)
                continue
            if isinstance(state, PoolingRequestState):
                if output.finish_reason is None:
                    continue  # the core sends a pooling request's output only when it finishes
                if not output.pooling_output:  # finished without its vector: that request fails, not the stream
                    error = InternalError(
                        f"the core finished pooling request {state.request_id} ({output.finish_reason}) "
                        "without its vector"
                    )
                    result.reqs_to_abort.extend(self._fail(state, error, iteration_stats))
                    if state.queue is None:
                        result.errors.append(error)
                    continue
                self._remove(state)
                if iteration_stats is not None:
                    iteration_stats.update_from_pooling_output(
                        engine_core_timestamp, len(state.prompt_token_ids), state.stats
                    )
                state.finish_stats(output.finish_reason, iteration_stats)
                pooled = state.make_output(output.pooling_output, output.num_cached_tokens)
                if state.queue is not None:
                    state.queue.put(pooled)
                else:
                    result.request_outputs.append(pooled)
                continue
            request_output, finish_reason = self._process_one(state, output)
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put(request_output)
                else:
                    result.request_outputs.append(request_output)
            if finish_reason is not None:
                self._remove(state)
                state.finish_stats(finish_reason, iteration_stats)
                if not output.finished:  # a stop string ended it: the core does not know yet
                    result.reqs_to_abort.append(state.request_id)
        return result

    def abort_requests(
        self, request_ids: Iterable[str], internal: bool = False, iteration_stats: IterationStats | None = None
    ) -> list[str]:
        """Forget requests: by the caller's id (every child of an n > 1 request) or by internal id (a parent's
        internal id covers its children). Streams waiting on a queue get ``abort`` outputs, through the parent's
        aggregation, so every completion ends; ``iteration_stats`` records them as finished (abort). Returns
        the internal ids to abort in the core. Linear in the requests and children named.

        ``AsyncLLM`` does the same in two parts, ``internal_ids`` and then ``finish_aborted`` in chunks, so that
        aborting 16384 children lets the event loop run between chunks."""
        internal_ids = self.internal_ids(request_ids, internal)
        self.finish_aborted(internal_ids, iteration_stats)
        return internal_ids

    def internal_ids(self, request_ids: Iterable[str], internal: bool = False) -> list[str]:
        """The internal ids of the requests named by the caller's ids (every child) or by internal ids (a
        parent's covers its children still running), each once."""
        internal_ids: list[str] = []
        for request_id in request_ids:
            if not internal:
                internal_ids.extend(self.external_req_ids.get(request_id, ()))
            elif request_id in self.parent_requests:
                internal_ids.extend(sorted(self.parent_requests[request_id].child_requests))
            else:
                internal_ids.append(request_id)
        return list(dict.fromkeys(internal_ids))

    def finish_aborted(self, internal_ids: Iterable[str], iteration_stats: IterationStats | None = None) -> None:
        """End these requests as aborted (see ``abort_requests``); ids no longer in flight are skipped. No
        output is built for a stream whose consumer has gone (a closed collector)."""
        for request_id in internal_ids:
            state = self.request_states.get(request_id)
            if state is None:
                continue
            self._remove(state)
            state.finish_stats(FinishReason.ABORT, iteration_stats)
            if state.queue is not None and state.queue.closed:
                continue
            if isinstance(state, PoolingRequestState):
                if state.queue is not None:  # an error, never an empty vector that would read as a result
                    abort_error = RequestAbortedError(f"pooling request {state.request_id} was aborted")
                    abort_error.request_id = state.external_req_id
                    state.queue.put(abort_error)
                continue
            state.detokenizer.finish()  # the text of ids left pending goes out with them
            aborted = state.make_request_output(FinishReason.ABORT, None)
            if aborted is not None and state.queue is not None:
                state.queue.put(aborted)

    def _fail(
        self, state: RequestState | PoolingRequestState, error: FrontendError, iteration_stats: IterationStats | None
    ) -> list[str]:
        """A request the core refused, failed or lost: its stream gets the error, which names it; n > 1 siblings
        are dropped too. Returns the siblings' internal ids, for the core to abort. A failure of the server counts
        in the metrics as finished with ``error``; a refusal of the request as sent (``CLIENT_ERROR_CODES``) does
        not, as vLLM never counts a request its input checks refuse."""
        error.request_id = state.external_req_id
        siblings = sorted(state.parent.child_requests - {state.request_id}) if state.parent is not None else []
        counted = error.status_code not in CLIENT_ERROR_CODES
        for request_id in [state.request_id, *siblings]:
            sibling = self.request_states.get(request_id)
            if sibling is not None:
                self._remove(sibling)
                if counted:
                    sibling.finish_stats(FinishReason.ERROR, iteration_stats)
        if state.queue is not None:
            state.queue.put(error)
        return siblings

    def _process_one(
        self, state: RequestState, output: EngineCoreOutput
    ) -> tuple[RequestOutput | None, FinishReason | None]:
        """The request's next output (None when its output kind holds it back) and, when it finished here,
        why (a stop string makes it STOP)."""
        new_token_ids = output.new_token_ids
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        state.num_cached_tokens = output.num_cached_tokens
        if output.new_prompt_logprobs is not None:
            state.logprobs.set_prompt_logprobs(output.new_prompt_logprobs)
        stop_string, num_surplus = state.detokenizer.update(new_token_ids, finish_reason == FinishReason.STOP)
        if num_surplus:
            new_token_ids = new_token_ids[: len(new_token_ids) - num_surplus]
        if stop_string is None and finish_reason is not None:
            stop_string = state.detokenizer.finish()
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        state.logprobs.update_sample_logprobs(output.new_logprobs[: len(new_token_ids)])
        request_output = state.make_request_output(finish_reason, stop_reason)
        return request_output, finish_reason

    def _remove(self, state: RequestState | PoolingRequestState) -> None:
        """Forget one request, in O(1): a parent goes with its last child."""
        self.request_states.pop(state.request_id, None)
        parent = state.parent
        if parent is not None:
            parent.child_requests.discard(state.request_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)
        siblings = self.external_req_ids.get(state.external_req_id)
        if siblings is not None:
            siblings.pop(state.request_id, None)
            if not siblings:
                del self.external_req_ids[state.external_req_id]
