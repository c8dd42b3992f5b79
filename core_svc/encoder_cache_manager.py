"""Which multimodal items' encoder outputs the model runner holds, counted in embedding rows (vLLM
``vllm/v1/core/encoder_cache_manager.py``, ``EncoderCacheManager``).

No torch: the scheduler decides with it, the runner keeps the tensors. An item's outputs are keyed by its
``identifier`` (content hash), so requests with the same image share one entry. An entry referenced by no
request stays cached ("freeable") and a later request reuses it, until space is needed: then the least recently
freed entries are evicted, and their identifiers reach the runner (``get_freed_mm_hashes``) so it drops them.
"""

from __future__ import annotations

from collections import OrderedDict

from core_svc.request import Request


class EncoderCacheManager:
    """The encoder cache's bookkeeping.

    Args:
        cache_size: capacity in embedding rows (tokens); at least the largest item's length.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # rows not held by any entry
        self.num_freeable_slots = cache_size  # rows free or held by unreferenced entries
        self.cached: dict[str, set[str]] = {}  # identifier -> ids of the requests that reference it
        self.lengths: dict[str, int] = {}  # identifier -> its rows
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced identifier -> its rows, oldest first
        self.freed: list[str] = []  # evicted since the last get_freed_mm_hashes

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether item ``input_id`` of ``request`` is cached; if so, ``request`` now references it."""
        identifier = request.mm_features[input_id].identifier
        if identifier not in self.cached:
            return False
        if not self.cached[identifier]:  # unreferenced: no longer evictable
            self.num_freeable_slots -= self.freeable.pop(identifier)
        self.cached[identifier].add(request.request_id)
        return True

    def can_allocate(
        self, request: Request, input_id: int, encoder_compute_budget: int, num_rows_to_schedule: int
    ) -> bool:
        """Whether item ``input_id`` fits the step's remaining compute budget and, with ``num_rows_to_schedule``
        rows already planned this step, the cache; evicts unreferenced entries to make room when that is enough."""
        num_rows = request.mm_features[input_id].length
        if num_rows > encoder_compute_budget:
            return False
        num_rows += num_rows_to_schedule
        if num_rows <= self.num_free_slots:
            return True
        if num_rows > self.num_freeable_slots:
            return False
        while num_rows > self.num_free_slots:
            identifier, num_free_rows = self.freeable.popitem(last=False)
            del self.cached[identifier]
            del self.lengths[identifier]
            self.freed.append(identifier)
            self.num_free_slots += num_free_rows
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve rows for item ``input_id`` of ``request``, which the runner encodes this step."""
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.lengths[feature.identifier] = feature.length
        self.num_free_slots -= feature.length
        self.num_freeable_slots -= feature.length

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """Indices of ``request``'s items that it references in the cache."""
        return {
            i
            for i, feature in enumerate(request.mm_features)
            if request.request_id in self.cached.get(feature.identifier, ())
        }

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """``request`` no longer needs item ``input_id``; the entry becomes freeable when nobody references it."""
        identifier = request.mm_features[input_id].identifier
        references = self.cached.get(identifier)
        if references is None or request.request_id not in references:
            return
        references.discard(request.request_id)
        if not references:
            num_rows = self.lengths[identifier]
            self.freeable[identifier] = num_rows
            self.num_freeable_slots += num_rows

    def free(self, request: Request) -> None:
        """Drop every reference of ``request`` (finished, aborted or preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def evict(self, identifiers: list[str]) -> None:
        """Remove entries whose outputs the runner does not hold (a failed step was to compute them), whoever
        references them; the runner is told to drop whatever it has for them."""
        for identifier in identifiers:
            if identifier not in self.cached:
                continue
            num_rows = self.lengths.pop(identifier)
            if self.cached.pop(identifier):
                self.num_freeable_slots += num_rows
            else:
                del self.freeable[identifier]
            self.num_free_slots += num_rows
            self.freed.append(identifier)

    def get_freed_mm_hashes(self) -> list[str]:
        """Identifiers evicted since the last call: the runner drops their outputs."""
        freed, self.freed = self.freed, []
        return freed
