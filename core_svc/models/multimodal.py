"""Multimodal item tensors as the wire carries them (``MultiModalTensor``: dtype, shape, row-major little-endian
bytes): checks and conversion to torch."""

from __future__ import annotations

import math

import torch

from core_svc.request import MultiModalTensor

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def wire_tensor_violation(
    name: str, tensor: MultiModalTensor | None, shape: tuple[int, ...], dtypes: tuple[str, ...]
) -> str | None:
    """Why ``tensor`` (the item's data[``name``]) is not a ``shape`` tensor of one of ``dtypes``, or None."""
    if tensor is None:
        return f"data[{name!r}] is missing"
    if tensor.dtype not in dtypes:
        return f"data[{name!r}] has dtype {tensor.dtype!r}; expected one of {', '.join(dtypes)}"
    if tuple(tensor.shape) != shape:
        return f"data[{name!r}] has shape {list(tensor.shape)}; the model expects {list(shape)}"
    expected = math.prod(shape) * WIRE_DTYPES[tensor.dtype].itemsize
    if len(tensor.data) != expected:
        return f"data[{name!r}] holds {len(tensor.data)} bytes; shape {list(shape)} of {tensor.dtype} is {expected}"
    return None


def wire_tensor_to_torch(tensor: MultiModalTensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The tensor, shape ``tensor.shape``, converted to ``dtype`` on ``device``. The bytes were checked by
    ``wire_tensor_violation``; little-endian as the wire says (every platform torch runs on here)."""
    flat = torch.frombuffer(bytearray(tensor.data), dtype=WIRE_DTYPES[tensor.dtype])
    return flat.reshape(tensor.shape).to(device=device, dtype=dtype)
