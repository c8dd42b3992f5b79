"""The adapters the core holds and the slots they occupy in a step (vLLM's ``LRUCacheLoRAModelManager``).

Every adapter registered (``add``) stays registered, by name, with its folder, content hash and int id, until
``remove``: requests may name it and ``list_loras`` lists it. Its weights are a cache: at most
``max_cpu_loras`` adapters keep theirs in host memory; registering or using another drops the least recently used
one's (those of an adapter a request uses stay held until it finishes, so host memory holds at most
``max_cpu_loras`` adapters plus those in use). A request naming an adapter whose weights were dropped has its
folder read again (``get``, on the engine thread, between two steps: a stall of one read of the adapter's files)
and the content hash checked: files changed since the adapter was registered fail that request rather than
serve other weights under the adapter's prefix-cache identity.

A step's adapters take device slots (``max_loras`` of them, the scheduler never runs more adapters at once): an
adapter already in a slot keeps it; another takes a free slot, else the least recently used slot whose adapter
the step does not use, and its weights are copied into every projection's slot.

An adapter removed while requests use it stays held, under its int id, until they finish: they finish with its
weights; new requests cannot name it. ``purge`` drops it once unused.

Methods run on the engine thread, except ``find`` and ``check_int_id``, which only read.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from core_svc.errors import InvalidRequestError, LoRAExistsError, LoRANotFoundError
from core_svc.lora.adapter import LoRAModel, LoRARequest
from core_svc.lora.layers import LoRALinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """An adapter the core serves: its request (name, int id, folder) and the sha256 of its files when read."""

    lora_request: LoRARequest
    content_hash: str


def same_folder(a: str, b: str) -> bool:
    """Whether two folder names name the same folder as written (``/p`` and ``/p/``, ``/a/./p``)."""
    return os.path.normpath(a) == os.path.normpath(b)


class LoRAManager:
    """Registered adapters by name, cached weights by name, held adapters by int id, and the device slots.

    Args:
        modules: every ``LoRALinear`` of the model by (layer index, module name) (``wrap_lora_modules``).
        max_loras: device slots.
        max_cpu_loras: adapters whose weights stay in host memory while no request uses them.
    """

    def __init__(self, modules: dict[tuple[int, str], LoRALinear], max_loras: int, max_cpu_loras: int) -> None:
        self.modules = modules
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.registered: dict[str, Registration] = {}  # name -> adapter, in the order registered
        self.loaded: OrderedDict[str, LoRAModel] = OrderedDict()  # name -> cached weights, least recently used first
        self.held: dict[int, LoRAModel] = {}  # lora_int_id -> adapter: the cached and the others still in use
        self.slots: list[int | None] = [None] * max_loras  # slot -> lora_int_id in it
        self._slot_order: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._next_int_id = itertools.count(1)

    # --- by name (the API) ---

    def find(self, lora_request: LoRARequest) -> LoRARequest | None:
        """The registered adapter of this name and folder (adding it again is a no-op, as vLLM's ``add_lora``), or
        None when the name is not registered.

        Raises:
            LoRAExistsError: the name is registered from another folder.
        """
        registration = self.registered.get(lora_request.lora_name)
        if registration is None:
            return None
        if not same_folder(registration.lora_request.lora_path, lora_request.lora_path):
            raise LoRAExistsError(
                f"lora_request.lora_name: adapter {lora_request.lora_name!r} is already loaded from "
                f"{registration.lora_request.lora_path!r}; remove it first to load {lora_request.lora_path!r} under "
                "that name"
            )
        return registration.lora_request

    def add(self, model: LoRAModel, in_use: set[int]) -> LoRARequest:
        """Register a read adapter under its name; returns it with its int id (the one asked for, else the next
        never given). ``in_use``: int ids of unfinished requests' adapters (their weights stay held).

        Raises:
            LoRAExistsError: the name is registered from another folder, or the int id asked for is another's.
        """
        existing = self.find(model.lora_request)
        if existing is not None:
            return existing
        wanted = model.lora_request.lora_int_id
        if wanted:
            self.check_int_id(wanted)
        int_id = wanted or self._new_int_id()
        request = LoRARequest(model.lora_request.lora_name, int_id, model.lora_request.lora_path)
        model.lora_request = request
        self.registered[request.lora_name] = Registration(request, model.content_hash)
        self.held[int_id] = model
        self._cache(model, in_use)
        logger.info(
            "loaded LoRA adapter %r (id %d, rank %d, %.1f MiB) from %s",
            request.lora_name,
            int_id,
            model.rank,
            model.num_bytes / 2**20,
            request.lora_path,
        )
        return request

    def check_int_id(self, int_id: int) -> None:
        """Raises LoRAExistsError when ``int_id`` is registered or held by an adapter."""
        owner = self.held.get(int_id)
        name = owner.lora_request.lora_name if owner is not None else None
        name = name or next((n for n, r in list(self.registered.items()) if r.lora_request.lora_int_id == int_id), None)
        if name is not None:
            raise LoRAExistsError(
                f"lora_request.lora_int_id: {int_id} is the id of adapter {name!r}; give 0 to have the engine "
                "core assign one"
            )

    def remove(self, lora_name: str, in_use: set[int]) -> None:
        """Unregister an adapter by name: requests can no longer name it; those using it finish with it.

        Raises:
            LoRANotFoundError: no adapter of that name is registered.
        """
        if self.registered.pop(lora_name, None) is None:
            raise LoRANotFoundError(f"lora_name: no LoRA adapter {lora_name!r} is loaded")
        self.loaded.pop(lora_name, None)
        self.purge(in_use)

    def get(self, lora_name: str, in_use: set[int], read: Callable[[LoRARequest], LoRAModel]) -> LoRAModel:
        """The registered adapter of that name, now the most recently used; its weights read again with ``read``
        (and checked against its content hash) when the cache dropped them.

        Raises:
            LoRANotFoundError: none is registered under it.
            InvalidRequestError: its folder can no longer be read or served, or its files changed.
        """
        registration = self.registered.get(lora_name)
        if registration is None:
            raise LoRANotFoundError(f"lora_request: LoRA adapter {lora_name!r} is not loaded")
        model = self.loaded.get(lora_name)
        if model is not None:
            self.loaded.move_to_end(lora_name)
            return model
        request = registration.lora_request
        model = self.held.get(request.lora_int_id)
        if model is None:
            model = read(request)
            if model.content_hash != registration.content_hash:
                raise InvalidRequestError(
                    "lora_request",
                    f"the files of LoRA adapter {lora_name!r} in {request.lora_path!r} changed since it was loaded; "
                    "unload it and load it again to serve the new ones",
                )
            model.lora_request = request
            self.held[request.lora_int_id] = model
            logger.info("read LoRA adapter %r again from %s (--max-cpu-loras)", lora_name, request.lora_path)
        self._cache(model, in_use)
        return model

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, in the order they were registered."""
        return [registration.lora_request for registration in self.registered.values()]

    def purge(self, in_use: set[int]) -> None:
        """Drop the held adapters whose weights are not cached and that no request uses (``in_use``: int ids of
        unfinished requests' adapters); their slots become free."""
        loaded_ids = {model.lora_request.lora_int_id for model in self.loaded.values()}
        for int_id in [i for i in self.held if i not in loaded_ids and i not in in_use]:
            del self.held[int_id]
            slot = self._slot_order.pop(int_id, None)
            if slot is not None:
                self.slots[slot] = None

    def _cache(self, model: LoRAModel, in_use: set[int]) -> None:
        """Keep ``model``'s weights as the most recently used, dropping the least recently used others' beyond
        ``max_cpu_loras`` (those no request uses first; those in use stay held until their requests finish)."""
        name = model.lora_request.lora_name
        self.loaded.pop(name, None)
        while len(self.loaded) >= self.max_cpu_loras:
            victim = next(
                (n for n, m in self.loaded.items() if m.lora_request.lora_int_id not in in_use), next(iter(self.loaded))
            )
            logger.info("dropping the weights of LoRA adapter %r from host memory (--max-cpu-loras)", victim)
            del self.loaded[victim]
        self.loaded[name] = model
        self.purge(in_use)

    @property
    def has_unloaded_held(self) -> bool:
        """Whether some held adapter's weights are no longer cached (``purge`` may free it)."""
        return len(self.held) > len(self.loaded)

    # --- slots (the model runner, per step) ---

    def replace_modules(self, modules: dict[tuple[int, str], LoRALinear]) -> None:
        """Serve a reloaded model's projections (sleep level 2, then wake up): their slots are empty, so every
        slot is forgotten and each adapter's weights are copied in again by the next ``activate`` that uses it."""
        self.modules = modules
        self.slots = [None] * self.max_loras
        self._slot_order.clear()

    def activate(self, int_ids: set[int]) -> dict[int, int]:
        """Give each adapter of a step a device slot, copying in the weights of those not in one; returns
        lora_int_id -> slot.

        Raises:
            RuntimeError: more adapters than slots (the scheduler admits no more than ``max_loras``), or an id the
                manager does not hold.
        """
        if len(int_ids) > self.max_loras:
            raise RuntimeError(f"a step uses {len(int_ids)} LoRA adapters, more than --max-loras {self.max_loras}")
        assigned: dict[int, int] = {}
        for int_id in sorted(int_ids):
            slot = self._slot_order.get(int_id)
            if slot is not None:
                self._slot_order.move_to_end(int_id)
                assigned[int_id] = slot
        for int_id in sorted(int_ids - assigned.keys()):
            model = self.held.get(int_id)
            if model is None:
                raise RuntimeError(f"LoRA adapter id {int_id} is not held by the engine core")
            slot = self._free_slot(set(assigned.values()))
            for key, module in self.modules.items():
                module.set_slot(slot, model.weights.get(key))
            self.slots[slot] = int_id
            self._slot_order[int_id] = slot
            assigned[int_id] = slot
        return assigned

    def _free_slot(self, taken: set[int]) -> int:
        """An empty slot, else the least recently used one not ``taken`` by this step (its adapter leaves it)."""
        for slot, int_id in enumerate(self.slots):
            if int_id is None:
                return slot
        for int_id, slot in self._slot_order.items():
            if slot not in taken:
                del self._slot_order[int_id]
                self.slots[slot] = None
                return slot
        raise RuntimeError("no LoRA slot is free")

    def _new_int_id(self) -> int:
        """The next id never given that no adapter has (registered, its weights cached or not, or held)."""
        taken = self.held.keys() | {r.lora_request.lora_int_id for r in self.registered.values()}
        while (int_id := next(self._next_int_id)) in taken:
            pass
        return int_id
