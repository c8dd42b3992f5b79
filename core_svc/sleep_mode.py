"""Sleep mode (vLLM's ``sleep`` / ``wake_up`` / ``is_sleeping``): which of the core's memory is released, and
giving freed host memory back to the operating system.

Two things can sleep, named by vLLM's wake-up tags: ``"weights"`` and ``"kv_cache"``. ``sleep(level=1)`` drops
the KV cache (its contents and the prefix cache are forgotten) and moves the weights to host memory (on CPU they
are there already and stay as they are); ``sleep(level=2)`` drops the weights too, reloaded from the checkpoint
on wake. ``wake_up(tags)`` restores what the tags name (None: both), weights first. The core is sleeping while
either is off; it takes requests again only once both are back.

Host memory: freeing a tensor returns its pages to glibc's malloc, which keeps small and medium chunks in its
arenas (glibc raises its mmap threshold up to 32 MiB after a large free, so even tensors of some MiB may come from
the heap, not from their own mapping). ``release_host_memory`` runs ``malloc_trim(0)``, which hands the free
pages of every arena back to the kernel, so the process's resident memory really drops. torch's CPU allocator
caches nothing (``posix_memalign`` / ``free``); safetensors' file mappings end with the ``safe_open`` that made
them, while loading.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import gc
import logging
from dataclasses import dataclass, field

from core_svc.errors import InvalidRequestError

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"
WAKE_UP_TAGS = (WEIGHTS_TAG, KV_CACHE_TAG)  # vLLM's order: the weights before the KV cache


class WeightsState(enum.Enum):
    """Where the weights are."""

    ON_DEVICE = "on_device"  # awake
    OFFLOADED = "offloaded"  # level 1 on an accelerator: in host memory, copied back on wake
    KEPT = "kept"  # level 1 on CPU: the device is the host, nothing to move
    DISCARDED = "discarded"  # level 2: gone, reloaded from the checkpoint on wake


@dataclass
class SleepState:
    """What is asleep now. ``level``: the deepest level since the core was last fully awake (0: awake)."""

    level: int = 0
    weights: WeightsState = WeightsState.ON_DEVICE
    kv_cache_dropped: bool = False

    @property
    def is_sleeping(self) -> bool:
        return self.weights != WeightsState.ON_DEVICE or self.kv_cache_dropped

    @property
    def sleeping_tags(self) -> list[str]:
        """The wake-up tags of what is off, in wake-up order."""
        tags = [WEIGHTS_TAG] if self.weights != WeightsState.ON_DEVICE else []
        return tags + ([KV_CACHE_TAG] if self.kv_cache_dropped else [])


@dataclass(frozen=True)
class SleepResult:
    """What one ``sleep`` call did."""

    level: int
    num_aborted_requests: int = 0  # requests in flight it ended (UNAVAILABLE)
    kv_cache_bytes_freed: int = 0  # bytes of KV cache tensors released
    weights_bytes_freed: int = 0  # bytes of weights released from the device (level 2: from memory)
    aborted_request_ids: list[str] = field(default_factory=list)


def check_sleep_level(level: int) -> int:
    """``level`` if it is 1 or 2.

    Raises:
        InvalidRequestError: naming ``level``; 0 (vLLM's pause of scheduling without freeing memory) included.
    """
    if level not in SLEEP_LEVELS:
        raise InvalidRequestError(
            "level",
            f"{level} is not a sleep level: 1 drops the KV cache and moves the weights to host memory, 2 drops the "
            "weights too",
        )
    return level


def check_wake_up_tags(tags: list[str] | None) -> list[str]:
    """The tags to wake, in wake-up order (weights first); None or empty: all of them.

    Raises:
        InvalidRequestError: naming ``tags[i]``, for a tag that is neither ``"weights"`` nor ``"kv_cache"``.
    """
    for i, tag in enumerate(tags or []):
        if tag not in WAKE_UP_TAGS:
            raise InvalidRequestError(f"tags[{i}]", f"{tag!r} is not a wake-up tag; choices: {', '.join(WAKE_UP_TAGS)}")
    return [tag for tag in WAKE_UP_TAGS if not tags or tag in tags]


def release_host_memory() -> bool:
    """Collect garbage, then give glibc's free heap pages back to the kernel (``malloc_trim(0)``); returns
    whether ``malloc_trim`` ran (False where the C library has none, e.g. musl or macOS)."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name)
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        logger.debug("no malloc_trim in %s: freed host memory stays with the allocator", libc_name)
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    malloc_trim(0)
    return True
