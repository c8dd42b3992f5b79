"""n > 1: one parent request fanned out to n child requests in the core (vLLM ``ParentRequest``)."""

from __future__ import annotations

from frontend_svc.outputs import CompletionOutput
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from frontend_svc.stats import IterationStats


class ParentRequest:
    """Children are ``"{index}_{parent_request_id}"`` with n = 1 and, when seeded, seed + index.

    Streaming kinds pass each child's completion on as it comes; FINAL_ONLY collects all n and releases them
    together. The parent is finished when every child is. Every call costs O(1) but the one that releases the
    FINAL_ONLY completions, O(n) once: so a request's whole life is linear in n.
    """

    def __init__(self, request_id: str, external_req_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.external_req_id = external_req_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        # Children not finished yet; the OutputProcessor also drops a child it removes (aborted or failed).
        self.child_requests: set[str] = set()
        self._aggregator: list[CompletionOutput | None] = (
            [None] * self.n if sampling_params.output_kind == RequestOutputKind.FINAL_ONLY else []
        )
        self._unseeded_child_params: SamplingParams | None = None  # shared by every child when unseeded (vLLM)
        self._num_children_counted = 0  # children whose finished stats are in (``observe_finished_child``)
        self._max_num_generation_tokens = 0

    def observe_finished_child(self, num_generation_tokens: int, iteration_stats: IterationStats) -> None:
        """A child's finished stats are in: once all n are, the parent's n and the most tokens one of its
        completions generated go to ``iteration_stats`` (vLLM's ``ParentRequest.observe_finished_request``)."""
        self._num_children_counted += 1
        self._max_num_generation_tokens = max(self._max_num_generation_tokens, num_generation_tokens)
        if self._num_children_counted == self.n:
            iteration_stats.n_params_iter.append(self.n)
            iteration_stats.max_num_generation_tokens_iter.append(self._max_num_generation_tokens)

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        return child_id, self._child_params(index)

    def _child_params(self, index: int) -> SamplingParams:
        """vLLM's ``_get_child_sampling_params``: a shallow copy with n = 1 (the lists are never changed after
        validation), one per child when seeded (seed + index), else one for all."""
        if self.sampling_params.seed is None:
            if self._unseeded_child_params is None:
                self._unseeded_child_params = self.sampling_params.child(index)
            return self._unseeded_child_params
        return self.sampling_params.child(index)

    def get_outputs(
        self, child_request_id: str, completion: CompletionOutput | None
    ) -> tuple[list[CompletionOutput], bool]:
        """Completions to release now and whether the parent is finished, given one child's new completion."""
        if completion is not None and completion.finished():
            self.child_requests.discard(child_request_id)
        finished = not self.child_requests
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return ([completion] if completion is not None else []), finished
        if completion is not None:
            self._aggregator[completion.index] = completion
        if not finished:
            return [], False
        return [c for c in self._aggregator if c is not None], True
