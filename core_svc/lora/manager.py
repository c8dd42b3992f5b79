"""The adapters the core holds and the slots they occupy in a step (vLLM's ``LRUCacheLoRAModelManager``).

Loaded adapters (at most ``max_cpu_loras``, in host memory) are found by name. A step's adapters take device
slots (``max_loras`` of them, the scheduler never runs more adapters at once): an adapter already in a slot keeps
it; another takes a free slot, else the least recently used slot whose adapter the step does not use, and its
weights are copied into every projection's slot. Loading beyond ``max_cpu_loras`` unloads the least recently
used adapter that no request uses (as vLLM's LRU cache; a request naming it later is NOT_FOUND until it is
loaded again).

An adapter removed (or unloaded) while requests use it stays held, under its int id, until they finish: they
finish with its weights; new requests cannot name it. ``purge`` drops it once unused.

Methods run on the engine thread, except ``find`` and ``check_int_id``, which only read.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from core_svc.errors import LoRACapacityError, LoRAExistsError, LoRANotFoundError
from core_svc.lora.adapter import LoRAModel, LoRARequest
from core_svc.lora.layers import LoRALinear

logger = logging.getLogger(__name__)


class LoRAManager:
    """Loaded adapters by name, held adapters by int id, and the device slots.

    Args:
        modules: every ``LoRALinear`` of the model by (layer index, module name) (``wrap_lora_modules``).
        max_loras: device slots.
        max_cpu_loras: adapters loaded at once.
    """

    def __init__(self, modules: dict[tuple[int, str], LoRALinear], max_loras: int, max_cpu_loras: int) -> None:
        self.modules = modules
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.loaded: OrderedDict[str, LoRAModel] = OrderedDict()  # name -> adapter, least recently used first
        self.held: dict[int, LoRAModel] = {}  # lora_int_id -> adapter: the loaded and the unloaded still in use
        self.slots: list[int | None] = [None] * max_loras  # slot -> lora_int_id in it
        self._slot_order: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._next_int_id = itertools.count(1)

    # --- by name (the API) ---

    def find(self, lora_request: LoRARequest) -> LoRARequest | None:
        """The loaded adapter of this name and folder (adding it again is a no-op, as vLLM's ``add_lora``), or None
        when the name is not loaded.

        Raises:
            LoRAExistsError: the name is loaded from another folder.
        """
        model = self.loaded.get(lora_request.lora_name)
        if model is None:
            return None
        if model.lora_request.lora_path != lora_request.lora_path:
            raise LoRAExistsError(
                f"lora_request.lora_name: adapter {lora_request.lora_name!r} is already loaded from "
                f"{model.lora_request.lora_path!r}; remove it first to load {lora_request.lora_path!r} under that name"
            )
        return model.lora_request

    def add(self, model: LoRAModel, in_use: set[int]) -> LoRARequest:
        """Register a read adapter under its name; returns it with its int id (the one asked for, else the next
        never given). ``in_use``: int ids of unfinished requests' adapters (never unloaded to make room).

        Raises:
            LoRAExistsError: the name is loaded from another folder, or the int id asked for is held by another.
            LoRACapacityError: ``max_cpu_loras`` adapters are loaded and every one is in use.
        """
        existing = self.find(model.lora_request)
        if existing is not None:
            return existing
        wanted = model.lora_request.lora_int_id
        if wanted:
            self.check_int_id(wanted)
        if len(self.loaded) >= self.max_cpu_loras:
            victim = next((name for name, m in self.loaded.items() if m.lora_request.lora_int_id not in in_use), None)
            if victim is None:
                raise LoRACapacityError(
                    f"{len(self.loaded)} LoRA adapters are loaded (--max-cpu-loras) and requests use every one; "
                    "remove one or wait"
                )
            logger.info("unloading LoRA adapter %r to make room (--max-cpu-loras %d)", victim, self.max_cpu_loras)
            self.remove(victim, in_use)
        int_id = wanted or self._new_int_id()
        request = LoRARequest(model.lora_request.lora_name, int_id, model.lora_request.lora_path)
        model.lora_request = request
        self.loaded[request.lora_name] = model
        self.held[int_id] = model
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
        """Raises LoRAExistsError when ``int_id`` is held by an adapter."""
        if int_id in self.held:
            raise LoRAExistsError(
                f"lora_request.lora_int_id: {int_id} is the id of adapter "
                f"{self.held[int_id].lora_request.lora_name!r}; give 0 to have the engine core assign one"
            )

    def remove(self, lora_name: str, in_use: set[int]) -> None:
        """Unload an adapter by name: requests can no longer name it; those using it finish with it.

        Raises:
            LoRANotFoundError: no adapter of that name is loaded.
        """
        model = self.loaded.pop(lora_name, None)
        if model is None:
            raise LoRANotFoundError(f"lora_name: no LoRA adapter {lora_name!r} is loaded")
        self.purge(in_use)

    def get(self, lora_name: str) -> LoRAModel:
        """The loaded adapter of that name, now the most recently used.

        Raises:
            LoRANotFoundError: none is loaded under it.
        """
        model = self.loaded.get(lora_name)
        if model is None:
            raise LoRANotFoundError(f"lora_request: LoRA adapter {lora_name!r} is not loaded")
        self.loaded.move_to_end(lora_name)
        return model

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters, in the order they were loaded or last named."""
        return [model.lora_request for model in self.loaded.values()]

    def purge(self, in_use: set[int]) -> None:
        """Drop the held adapters that are no longer loaded and that no request uses (``in_use``: int ids of
        unfinished requests' adapters); their slots become free."""
        loaded_ids = {model.lora_request.lora_int_id for model in self.loaded.values()}
        for int_id in [i for i in self.held if i not in loaded_ids and i not in in_use]:
            del self.held[int_id]
            slot = self._slot_order.pop(int_id, None)
            if slot is not None:
                self.slots[slot] = None

    @property
    def has_unloaded_held(self) -> bool:
        """Whether some held adapter is no longer loaded (``purge`` may free it)."""
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
        while (int_id := next(self._next_int_id)) in self.held:
            pass
        return int_id
