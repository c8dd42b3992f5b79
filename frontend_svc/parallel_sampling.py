"""n > 1: one parent request fanned out to n child requests in the core (vLLM ``ParentRequest``)."""

from __future__ import annotations

from frontend_svc.outputs import CompletionOutput
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """Children are ``"{index}_{parent_request_id}"`` with n = 1 and, when seeded, seed + index.

    Streaming kinds pass each child's completion on as it comes; FINAL_ONLY collects all n and releases them
    together. The parent is finished when every child is.
    """

    def __init__(self, request_id: str, external_req_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.external_req_id = external_req_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.child_requests: set[str] = set()
        self._aggregator: list[CompletionOutput | None] = [None] * self.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        return child_id, self.sampling_params.child(index)

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
