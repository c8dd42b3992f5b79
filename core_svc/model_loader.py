"""Find a checkpoint, read its config with transformers, and load its safetensors weights into our model.

Accepts a local Hugging Face folder (config.json, model.safetensors or sharded model-*.safetensors with
model.safetensors.index.json, generation_config.json) or a hub id, fetched with huggingface_hub when the
machine is online.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core_svc.config import QUANTIZATION_METHODS
from core_svc.errors import ModelLoadError
from core_svc.image_processor_config import QWEN2_VL_MODEL_TYPES, read_image_processor_config
from core_svc.models.arch import ModelArchConfig
from core_svc.models.interfaces import ServedModel
from core_svc.models.layers import (
    GEMV_MAX_ROWS,
    PANEL_WIDTH,
    Linear,
    RotaryEmbedding,
    compiled_gemv,
    prepack_linear_weights,
)
from core_svc.models.llama import LlamaForCausalLM
from core_svc.models.llava import LlavaForConditionalGeneration
from core_svc.models.quantization import quantize_linear_weights
from core_svc.models.qwen2_vl import Qwen2VLForConditionalGeneration
from kernels import AttentionBackend
from kernels.attention import cpu_ops
from splitserve.base import envs, model_files

logger = logging.getLogger(__name__)

# architecture -> model class; every other supported architecture is served by LlamaForCausalLM
ModelClass = Callable[[ModelArchConfig, AttentionBackend, torch.dtype], ServedModel]
MODEL_CLASSES: dict[str, ModelClass] = {
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,  # the same code, its tower's options
}


@dataclass(frozen=True)
class LoadedModel:
    model: ServedModel
    arch: ModelArchConfig
    path: Path
    eos_token_ids: list[int]  # generation_config's EOS ids first, else config.json's; may be empty
    num_parameters: int  # the model's parameters (a tied embedding counted once)
    weights_bytes: int  # their bytes, in the dtype they were loaded in (before prepacking or quantizing)
    load_time_s: float  # wall-clock seconds of load_model: build, reading weights, prepacking (not the config)


def resolve_model_path(model: str) -> Path:
    """A local folder, or a hub id fetched with huggingface_hub. Raises ModelLoadError when neither works."""
    try:
        return model_files.resolve_model_path(model)
    except model_files.ModelNotFoundError as e:
        raise ModelLoadError(str(e)) from e


def load_hf_config(path: Path) -> object:
    """transformers config of the checkpoint. Raises ModelLoadError when config.json is missing or invalid."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face checkpoint folder?")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e


def _load_cpu_kernels_for_layouts() -> str | None:
    """Load the compiled CPU kernels (``kernels.attention.cpu_ops.load``; the CPU attention backend already has,
    unless another backend was chosen) before the weights are laid out: ``quantize_linear_weights`` decides whether
    int8 weights take the AVX2 kernel's panels; ``prepack_linear_weights`` which dense copies pay
    (``keep_dense=True``), whether bfloat16 weights stay dense for the AMX kernel and whether float32 ones take the
    panel kernel's layout. So the decisions do not depend on the attention backend, and every later step sees the
    same kernels. Returns why they cannot be loaded, or None."""
    try:
        cpu_ops.load(envs.kernel_dir())
    except cpu_ops.KernelBuildError as e:
        return e.reason
    return None


def _why_none(dtype: torch.dtype, kernels_missing: str | None, amx: bool) -> str:
    """Why ``prepack_linear_weights(keep_dense=True)`` kept no dense copy of a CPU model in ``dtype``; ``amx``: its
    weights stayed dense for the AMX kernel."""
    name = str(dtype).removeprefix("torch.")
    if amx:
        return f"the {name} weights stay dense for the AMX kernel, and few rows already use the matrix-vector kernel"
    if kernels_missing is not None:
        return f"the compiled CPU kernels are not loaded ({kernels_missing})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the compiled matrix-vector kernel has no {name} build"
    if compiled_gemv(dtype) is None:
        needs = "AVX-512F" if dtype == torch.float32 else "AVX512_BF16"
        return f"no compiled matrix-vector kernel for {name} on this CPU (it needs {needs})"
    return f"torch has no oneDNN {name} here, so the weights keep their loaded layout"


def _layouts(model: nn.Module, dtype: torch.dtype) -> str:
    """What ``prepack_linear_weights`` made of the linear weights, for the load log."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    packed = sum(m.packed_weight is not None for m in linears)
    panels = sum(m.panel_weight is not None for m in linears)
    column_major = sum(m.weight is not None and not m.weight.is_contiguous() for m in linears)
    amx = sum(m.amx for m in linears)
    text = ", ".join(
        f"{n} {what}"
        for n, what in (
            (panels, f"in panels of {PANEL_WIDTH} output features (the float32 panel kernel)"),
            (column_major, "column-major (MKL)"),
            (amx, f"dense for the AMX kernel (the matrix-vector kernel up to {GEMV_MAX_ROWS} rows)"),
            (packed, "packed for oneDNN"),
        )
        if n
    )
    kept = sum(m.dense_weight is not None and not m.amx for m in linears)
    if kept and compiled_gemv(dtype) is not None:
        text += f"; {kept} keep a dense copy for steps of at most {GEMV_MAX_ROWS} rows (compiled matrix-vector kernel)"
    return text


def load_model(
    path: Path,
    hf_config: object,
    dtype: torch.dtype | None,
    device: torch.device,
    backend: AttentionBackend,
    quantization: str | None = None,
    *,
    dense_decode_weights: bool = False,
) -> LoadedModel:
    """Build our model for the checkpoint at ``path`` and load every weight. Logs its size and load time at INFO
    (vLLM's "Model loading took 13.48 GiB and 12.3 seconds", with the parameter count and dtype).

    Args:
        hf_config: the checkpoint's config (``load_hf_config``).
        dtype: parameter dtype; None keeps the checkpoint's.
        quantization: None, or "int8": every ``Linear`` weight quantized to int8 per output channel after
            loading (``quantize_linear_weights``; CPU only), instead of being prepacked.
        dense_decode_weights: linear weights keep their dense copy for steps of few rows beside their batch
            layout (``prepack_linear_weights``).

    Raises:
        ModelLoadError: missing or unreadable files, unsupported architecture or option, a missing, unexpected
            or wrongly shaped tensor.
    """
    start = time.perf_counter()
    arch = ModelArchConfig.from_hf_config(hf_config)
    if arch.is_multimodal:
        arch = replace(arch, image_processor=_image_processor_config(path, getattr(hf_config, "model_type", None)))
    dtype = dtype or arch.dtype
    with torch.device("meta"):
        model = MODEL_CLASSES.get(arch.architecture, LlamaForCausalLM)(arch, backend, dtype)
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_table()
    _load_weights(model, _weight_files(path))
    model.eval()
    # Counted before prepacking, which lays the linear weights out anew (packed ones have no storage to count).
    params = list(model.parameters())  # shared (tied) parameters once
    num_parameters = sum(p.numel() for p in params)
    weights_bytes = sum(p.numel() * p.element_size() for p in params)
    if quantization == "int8":
        if device.type == "cpu":
            _load_cpu_kernels_for_layouts()
        num_quantized = quantize_linear_weights(model)
        tensors = [*model.parameters(), *model.buffers()]
        panels = any(getattr(m, "weight_panels", None) is not None for m in model.modules())
        logger.info(
            "%d linear weights quantized to int8 per output channel (%s): %s of weights and buffers now",
            num_quantized,
            "a second copy in panels for the AVX2 int8 kernel, W8A8 at every row count"
            if panels
            else "W8A8 beyond a few rows",
            format_bytes(sum(t.numel() * t.element_size() for t in tensors)),
        )
    elif quantization is not None:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choices: {', '.join(QUANTIZATION_METHODS)}")
    else:
        kernels_missing = None
        weights_dtype = next(model.parameters()).dtype
        if device.type == "cpu" and (dense_decode_weights or weights_dtype in (torch.float32, torch.bfloat16)):
            kernels_missing = _load_cpu_kernels_for_layouts()
        if prepack_linear_weights(model, keep_dense=dense_decode_weights):
            logger.info("linear weights laid out for batches: %s", _layouts(model, dtype))
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        kept = any(m.dense_weight is not None and not m.amx for m in linears)
        if dense_decode_weights and device.type == "cpu" and not kept:
            amx = any(m.amx for m in linears)
            logger.warning(
                "--dense-decode-weights has no effect here: %s; no dense copies kept",
                _why_none(dtype, kernels_missing, amx),
            )
    load_time_s = time.perf_counter() - start
    logger.info(
        "Model loading took %s (%s parameters, %s) and %.2f seconds",
        format_bytes(weights_bytes),
        f"{num_parameters:,}",
        str(dtype).removeprefix("torch."),
        load_time_s,
    )
    return LoadedModel(
        model=model,
        arch=arch,
        path=path,
        eos_token_ids=_eos_token_ids(path, hf_config),
        num_parameters=num_parameters,
        weights_bytes=weights_bytes,
        load_time_s=load_time_s,
    )


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in GiB from 1 GiB up, else in MiB, two decimals ("13.48 GiB", "15.63 MiB")."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.2f} MiB"


def _image_processor_config(path: Path, model_type: str | None) -> dict[str, Any]:
    """The checkpoint's image processor settings (``read_image_processor_config``: processor_config.json's
    "image_processor", else preprocessor_config.json, as the frontend's transformers processor reads them); {}
    without either. Qwen2-VL's image size bounds are checked here, so a bad one names its file.

    Raises:
        ModelLoadError: a file that is not a JSON object; Qwen2-VL: "size" not a JSON object or a bound not a
            positive integer, naming the file and key.
    """
    try:
        config = read_image_processor_config(path)
        if model_type in QWEN2_VL_MODEL_TYPES:
            config.max_pixels()
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return dict(config.settings)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists weight files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _load_weights(model: ServedModel, files: list[Path]) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    filled: dict[str, set[int | None]] = {name: set() for name in params}
    unexpected: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    target = model.checkpoint_param_name(name)
                    if target is None:
                        continue
                    param_name, shard = target
                    if param_name not in params:
                        unexpected.append(name)
                        continue
                    _copy_into(model, params[param_name], param_name, shard, f.get_tensor(name), name)
                    filled[param_name].add(shard)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has tensors the model does not use: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = [
        name
        for name, shards in filled.items()
        if not shards or (None not in shards and len(shards) < len(model.shard_sizes(name)))
    ]
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors for: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _copy_into(
    model: ServedModel,
    param: torch.nn.Parameter,
    param_name: str,
    shard: int | None,
    tensor: torch.Tensor,
    checkpoint_name: str,
) -> None:
    if shard is None:
        target = param.data
    else:
        sizes = model.shard_sizes(param_name)
        start = sum(sizes[:shard])
        target = param.data.narrow(0, start, sizes[shard])
    if target.shape != tensor.shape:
        raise ModelLoadError(
            f"tensor {checkpoint_name} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}"
        )
    target.copy_(tensor)


def _eos_token_ids(path: Path, hf_config: object) -> list[int]:
    eos = None
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        try:
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
        except ValueError:
            logger.warning("ignoring unreadable %s", generation_config)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
