"""A PEFT LoRA adapter folder read into the core's fused projections (vLLM's ``LoRAModel.from_local_checkpoint``).

The folder holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and ``adapter_model.safetensors`` with, per
adapted projection, ``...layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in_features]`` and ``lora_B.weight``
``[out_features, r]``. The core's Llama-family models fuse q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` (``core_svc.models.llama.STACKED_PARAMS``): each checkpoint projection becomes one slice of its
fused module, in the fused module's order. The update of a slice is ``B @ A @ x * scaling`` with PEFT's
``scaling = lora_alpha / r`` (rsLoRA, ``use_rslora``: ``lora_alpha / sqrt(r)``), folded into B here.

Everything a folder can get wrong is refused with ``InvalidRequestError`` (INVALID_ARGUMENT) naming
``lora_request.lora_path`` and the reason: missing or unreadable files, a rank above ``--max-lora-rank``, a
module the model does not have or the core does not adapt (embeddings, ``lm_head``), shapes that do not fit the
model, and every PEFT setting the core does not implement (an allowlist: DoRA, biases, ``modules_to_save``,
per-module ranks, aLoRA, QALoRA, layer replication, ``fan_in_fan_out``, ... each refused naming its field).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from core_svc.errors import InvalidRequestError
from core_svc.models.arch import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PATH_FIELD = "lora_request.lora_path"

# checkpoint projection -> (the core's module, slice index in its output); o_proj and down_proj are not fused.
FUSED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# The core's adaptable modules and their number of slices.
NUM_SLICES: dict[str, int] = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter as vLLM names it (``vllm/lora/request.py``): its name (what requests give), the core's int id
    (>= 1, unique among the adapters the core holds) and its folder on the core's file system."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class LoRAModel:
    """One adapter's weights, on the host, per decoder layer and core module (vLLM's ``LoRAModel``)."""

    lora_request: LoRARequest  # lora_int_id 0 until the manager registers it
    rank: int  # PEFT's r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; already folded into the B weights
    content_hash: str  # sha256 (hex) of the config file's and the weights file's bytes: the adapter's identity
    # (layer index, core module) -> per slice: (A [rank, in_features], B * scaling [slice_out_features, rank]),
    # float32, or None for a slice the adapter leaves alone
    weights: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for slices in self.weights.values() for s in slices if s for a, b in [s])


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each checkpoint projection of ``arch``."""
    q, kv = arch.num_attention_heads * arch.head_size, arch.num_key_value_heads * arch.head_size
    hidden, intermediate = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def max_weights_bytes(arch: ModelArchConfig, max_lora_rank: int) -> int:
    """The largest ``adapter_model.safetensors`` a servable adapter can have: every projection of every layer at
    ``max_lora_rank`` in float64 (the widest float a checkpoint holds in practice), plus its header."""
    elements = max_lora_rank * sum(i + o for i, o in module_shapes(arch).values()) * arch.num_hidden_layers
    header = 256 * 2 * len(FUSED_MODULES) * arch.num_hidden_layers + 2**20
    return 8 * elements + header


def load_lora_model(lora_request: LoRARequest, arch: ModelArchConfig, max_lora_rank: int) -> LoRAModel:
    """Read and check the PEFT adapter folder ``lora_request.lora_path`` for a model of ``arch``: the config
    first (its rank against ``max_lora_rank``), then the weights file's size against the largest such an adapter
    can have, before its bytes are read (in chunks, hashed as they come; the bytes parsed are those hashed).

    Raises:
        InvalidRequestError: naming ``lora_request.lora_path`` and the reason (see the module docstring).
    """
    folder = Path(lora_request.lora_path)
    config_path = folder / CONFIG_FILE
    if not lora_request.lora_path or not config_path.is_file():
        # One answer for "no such folder" and "no config in it": the caller learns nothing of other paths.
        raise InvalidRequestError(
            PATH_FIELD, f"{lora_request.lora_path!r} is not a folder on the engine core holding {CONFIG_FILE}"
        )
    config_bytes, _ = _read(config_path, MAX_CONFIG_BYTES)
    config = _lora_config(config_bytes)
    rank, alpha = config["r"], config["lora_alpha"]
    if rank > max_lora_rank:
        raise InvalidRequestError(
            PATH_FIELD, f"the adapter's rank r={rank} is above the engine core's --max-lora-rank {max_lora_rank}"
        )
    scaling = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    digest = hashlib.sha256(hashlib.sha256(config_bytes).digest())
    weights_bytes, content_hash = _read(folder / WEIGHTS_FILE, max_weights_bytes(arch, max_lora_rank), digest)
    try:
        tensors = load_safetensors(weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise InvalidRequestError(PATH_FIELD, f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    weights = _fused_weights(tensors, arch, rank, scaling)
    return LoRAModel(lora_request, rank, scaling, content_hash, weights)


MAX_CONFIG_BYTES = 2**20
_CHUNK_BYTES = 2**22


def _read(path: Path, limit: int, digest: Any = None) -> tuple[bytes, str]:
    """The file's bytes, at most ``limit`` of them (checked before reading, and while reading: a file that grows
    meanwhile), read in chunks into ``digest`` (a hashlib object; a new sha256 when None); and its hex digest.

    Raises:
        InvalidRequestError: missing, unreadable, or over ``limit``.
    """
    digest = digest if digest is not None else hashlib.sha256()
    too_large = InvalidRequestError(
        PATH_FIELD, f"{path.name} is larger than any adapter this engine core can serve ({limit} bytes at most)"
    )
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise too_large
            data = bytearray()
            while chunk := f.read(min(_CHUNK_BYTES, limit + 1 - len(data))):
                digest.update(chunk)
                data += chunk
                if len(data) > limit:
                    raise too_large
    except FileNotFoundError:
        raise InvalidRequestError(PATH_FIELD, f"the adapter folder has no {path.name}") from None
    except IsADirectoryError:
        raise InvalidRequestError(PATH_FIELD, f"{path.name} is not a file") from None
    except OSError as e:
        raise InvalidRequestError(PATH_FIELD, f"cannot read {path.name}: {e.strerror or e}") from None
    return bytes(data), digest.hexdigest()


# PEFT LoraConfig fields that say nothing about the weights' meaning at inference (any value is served).
_METADATA_FIELDS = frozenset(
    {
        "peft_type",
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",  # training only
        "layers_to_transform",  # the weights file holds only those layers; each weight names its layer
        "layers_pattern",
        "megatron_core",  # meaningful only with megatron_config
        "qalora_group_size",  # meaningful only with use_qalora
        # The weights file holds the modules trained, and the core serves what it holds, as vLLM judges an
        # adapter by its weights: which modules were asked for or left out does not matter.
        "target_modules",
        "exclude_modules",
        "eva_config",  # EVA's data-driven initialization of A: a plain LoRA once trained
    }
)
# Fields the core reads (checked below).
_SERVED_FIELDS = frozenset({"r", "lora_alpha", "use_rslora", "bias", "init_lora_weights"})
# Every other field PEFT knows, with the value that means "not used": any other value is refused, naming it.
_DEFAULT_FIELDS: dict[str, Any] = {
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "megatron_config": None,
    "trainable_token_indices": None,
    "loftq_config": {},
    "corda_config": None,
    "lora_ga_config": None,
    "use_dora": False,
    "velora_config": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "monteclora_config": None,
    "layer_replication": None,
    "lora_bias": False,
    "target_parameters": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "ensure_weight_tying": False,
}
_FEATURE_NAMES = {
    "use_dora": "DoRA (use_dora)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
}


# init_lora_weights values that only choose A and B's starting values, the base weights unchanged: a plain LoRA
# at inference (vLLM's PEFTHelper takes the same ones, any case).
_PLAIN_INITS = frozenset({"gaussian", "orthogonal", "eva"})


def _is_unset(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, dict | list | tuple | set | str) and not value)


def _lora_config(config_bytes: bytes) -> dict[str, Any]:
    """The settings the core reads from ``adapter_config.json`` (these bytes), through PEFT's own ``LoraConfig``
    when peft is installed (its defaults and checks), else from the JSON with PEFT's defaults. An allowlist: a
    field the core does not implement with a value other than its "unused" one is refused, naming it, and so is a
    field neither the core nor PEFT's known set names, unless unset (a newer PEFT's feature).

    Raises:
        InvalidRequestError: not JSON, not a LoRA adapter, or a feature the core does not serve.
    """
    try:
        raw = json.loads(config_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(PATH_FIELD, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError(PATH_FIELD, f"{CONFIG_FILE} is not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InvalidRequestError(PATH_FIELD, f"the adapter is a {peft_type} adapter, not LoRA")
    known = _METADATA_FIELDS | _SERVED_FIELDS | _DEFAULT_FIELDS.keys()
    for key, value in raw.items():
        if key not in known and not _is_unset(value):
            raise InvalidRequestError(
                PATH_FIELD, f"{CONFIG_FILE} sets {key}={value!r}, a setting the engine core does not serve"
            )
    config: dict[str, Any] = dict(raw)
    try:
        from peft import LoraConfig
    except ImportError:
        pass
    else:
        try:  # the bytes read here, not the file again (it may have changed meanwhile)
            kwargs = {key: value for key, value in raw.items() if key in known}
            config = LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**{**kwargs, "peft_type": "LORA"})).to_dict()
        except Exception as e:  # peft raises TypeError, ValueError, ... for settings it refuses
            raise InvalidRequestError(PATH_FIELD, f"{CONFIG_FILE} is not a valid LoRA config: {e}") from None
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequestError(PATH_FIELD, f"the adapter's rank r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidRequestError(PATH_FIELD, f"lora_alpha must be a number, got {alpha!r}")
    for key, default in _DEFAULT_FIELDS.items():
        value = config.get(key, default)
        if value != default and not (_is_unset(value) and _is_unset(default)):
            what = _FEATURE_NAMES.get(key, f"{key}={value!r}")
            raise InvalidRequestError(PATH_FIELD, f"the adapter uses {what}, which the engine core does not serve")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError(
            PATH_FIELD, f"the adapter trains biases (bias={config['bias']!r}); the engine core serves bias='none'"
        )
    init = config.get("init_lora_weights", True)
    if not (init is True or init is False or str(init).lower() in _PLAIN_INITS):
        # PiSSA, OLoRA, LoftQ, CorDA ... change the base weights at initialization: served only once converted
        # to a plain LoRA (peft's path_initial_model_for_weight_conversion), which records init_lora_weights=True.
        raise InvalidRequestError(
            PATH_FIELD,
            f"the adapter uses init_lora_weights={init!r}, which trains against changed base weights; the engine "
            "core serves adapters of the unchanged base model (convert it to a plain LoRA with peft)",
        )
    return {"r": rank, "lora_alpha": float(alpha), "use_rslora": bool(config.get("use_rslora", False))}


def _fused_weights(
    tensors: dict[str, torch.Tensor], arch: ModelArchConfig, rank: int, scaling: float
) -> dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """Pair each projection's A and B, check their shapes against ``arch``, and place them as slices of the core's
    fused modules (B scaled, both float32)."""
    shapes = module_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise InvalidRequestError(
                PATH_FIELD,
                f"weight {key!r} is not a LoRA weight of a decoder projection the engine core adapts "
                f"({', '.join(FUSED_MODULES)})",
            )
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in FUSED_MODULES:
            raise InvalidRequestError(PATH_FIELD, f"weight {key!r}: the model has no adaptable module {module!r}")
        if layer >= arch.num_hidden_layers:
            raise InvalidRequestError(
                PATH_FIELD, f"weight {key!r}: layer {layer}, but the model has {arch.num_hidden_layers} layers"
            )
        in_features, out_features = shapes[module]
        expected = (rank, in_features) if side == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise InvalidRequestError(
                PATH_FIELD,
                f"weight {key!r} has shape {list(tensor.shape)}, the model and r={rank} need {list(expected)}",
            )
        if not tensor.is_floating_point():
            raise InvalidRequestError(PATH_FIELD, f"weight {key!r} is {tensor.dtype}, not a float tensor")
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise InvalidRequestError(PATH_FIELD, f"{WEIGHTS_FILE} holds no LoRA weight")
    weights: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        if len(pair) != 2:
            missing = "B" if "A" in pair else "A"
            raise InvalidRequestError(PATH_FIELD, f"layer {layer} {module} has no lora_{missing} weight")
        fused, index = FUSED_MODULES[module]
        slices = weights.setdefault((layer, fused), [None] * NUM_SLICES[fused])
        slices[index] = (pair["A"].float().contiguous(), (pair["B"].float() * scaling).contiguous())
    return weights
