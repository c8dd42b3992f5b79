"""What the benchmarks share: the seeded checkpoint, the seeded request set, model FLOPs, and a description of the
machine (CPU and its flags, the GPU when one is used) and library versions. The device's measured limits (matmul
peak, copy bandwidth) are in ``device_limits``."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.base import envs
from splitserve.entrypoints.demo import cached_test_model

# ShareGPT's prompt lengths are long-tailed: most prompts are short, a few are long. A log-normal with median 100
# and sigma 0.8 has mean ~140 and a 99th percentile ~640, clipped to 16..1024 tokens.
PROMPT_LEN_MEDIAN = 100
PROMPT_LEN_SIGMA = 0.8
PROMPT_LEN_RANGE = (16, 1024)


def splitserve_precision(name: str) -> dict[str, str | bool]:
    """``CoreConfig`` fields of a splitserve precision the benchmarks name: a dtype (float32, bfloat16,
    float16), int8: float32 with int8 linears (``--quantization int8``), a dtype with ``-dense`` (float32-dense,
    bfloat16-dense): that dtype with dense weights for few-row steps (``--dense-decode-weights``); any of these with
    ``-kv-bfloat16`` or ``-kv-float32`` (float32-kv-bfloat16, int8-kv-float32): with that KV cache
    (``--kv-cache-dtype``; int8's own is bfloat16)."""
    for kv_dtype in ("bfloat16", "float32"):
        if name.endswith(suffix := f"-kv-{kv_dtype}"):
            return splitserve_precision(name.removesuffix(suffix)) | {"kv_cache_dtype": kv_dtype}
    if name == "int8":
        return {"dtype": "float32", "quantization": "int8"}
    if name in ("float32-dense", "bfloat16-dense"):  # the dtypes that keep dense copies (prepack_linear_weights)
        return {"dtype": name.removesuffix("-dense"), "dense_decode_weights": True}
    return {"dtype": name}


def matmul_dtype(name: str) -> str:
    """The dtype whose matmul peak a splitserve precision's MFU is over: its ``dtype`` (int8's products run at
    another peak, not measured: float32's stands in)."""
    return str(splitserve_precision(name)["dtype"])


def default_tokenizer_dir() -> Path | None:
    """The llama2 tokenizer the request set draws ids from: ``$SPLITSERVE_TOKENIZERS_DIR/llama2``, else the
    project's ``../shared/tokenizers/llama2``; None when neither exists (the builtin tokenizer is used)."""
    candidates = []
    if (tokenizers_dir := envs.tokenizers_dir()) is not None:
        candidates.append(tokenizers_dir / "llama2")
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "llama2")
    return next((c for c in candidates if (c / "tokenizer_config.json").is_file()), None)


def bench_model_path(arch: str, preset: str, tokenizer: Path | None, seed: int = 0) -> Path:
    """A seeded ``make-test-model`` checkpoint in the cache folder, built on first use (a few seconds)."""
    name = f"bench-{arch}-{preset}-{tokenizer.name if tokenizer else 'builtin'}-seed{seed}"
    return cached_test_model(name, arch=arch, preset=preset, tokenizer=tokenizer, seed=seed)


@dataclass(frozen=True)
class RequestSet:
    """Seeded prompts of random token ids, each generating exactly ``output_len`` tokens (EOS ignored); with the
    image workload (``image_workload``), each prompt's encoded images in placeholder order."""

    prompts: list[list[int]]
    output_len: int
    seed: int
    images: list[list[bytes]] = field(default_factory=list)  # request -> its PNGs; empty: text only
    image_sizes: list[list[int]] = field(default_factory=list)  # the [width, height] the images cycle through

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def summary(self) -> dict[str, Any]:
        lens = np.asarray(self.prompt_lens)
        return {
            "num_requests": len(self.prompts),
            "output_len": self.output_len,
            "seed": self.seed,
            "prompt_len_mean": float(lens.mean()),
            "prompt_len_p50": float(np.percentile(lens, 50)),
            "prompt_len_p99": float(np.percentile(lens, 99)),
            "prompt_len_max": int(lens.max()),
            "input_tokens": int(lens.sum()),
            "output_tokens": len(self.prompts) * self.output_len,
            "images_per_request": len(self.images[0]) if self.images else 0,
            "image_sizes": self.image_sizes,
            "image_bytes": sum(len(image) for images in self.images for image in images),
        }

    def head(self, num_requests: int, output_len: int) -> RequestSet:
        """The first ``num_requests`` requests, with their images, generating ``output_len`` tokens (a warm-up)."""
        return RequestSet(
            self.prompts[:num_requests], output_len, self.seed, self.images[:num_requests], self.image_sizes
        )


def make_request_set(num_requests: int, output_len: int, tokenizer: Any, seed: int = 0) -> RequestSet:
    """Prompt lengths log-normal (``PROMPT_LEN_*``), token ids uniform over the tokenizer's ordinary (non-special)
    tokens, all from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    lo, hi = PROMPT_LEN_RANGE
    lens = np.clip(rng.lognormal(np.log(PROMPT_LEN_MEDIAN), PROMPT_LEN_SIGMA, num_requests).astype(int), lo, hi)
    special = set(tokenizer.all_special_ids)
    vocab = np.asarray([i for i in range(len(tokenizer)) if i not in special])
    prompts = [rng.choice(vocab, size=int(n)).tolist() for n in lens]
    return RequestSet(prompts=prompts, output_len=output_len, seed=seed)


@dataclass(frozen=True)
class ModelFlops:
    """Model FLOPs (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", C_forward ~ 2N + attention):
    each token through the decoder costs 2 x the non-embedding matmul parameters plus attention's
    2 x 2 x context x num_heads x head_size per layer; the LM head (2 x hidden x vocab) is counted only for the
    rows whose logits the work needs, the sampled tokens, since prompt positions need none."""

    non_embedding_matmul_params: int
    lm_head_params: int
    num_layers: int
    attention_width: int  # num_heads x head_size

    @classmethod
    def from_checkpoint(cls, path: Path) -> ModelFlops:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_size, cfg.num_key_value_heads * head_size
        per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        return cls(
            non_embedding_matmul_params=per_layer * cfg.num_hidden_layers,
            lm_head_params=cfg.hidden_size * cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            attention_width=q,
        )

    def request_flops(self, prompt_len: int, output_len: int, lm_head_on_every_token: bool = False) -> float:
        """FLOPs to generate ``output_len`` tokens after ``prompt_len``: every token but the last generated one
        goes through the decoder (at positions 0 .. n-1); each generated token is sampled from LM head logits.
        ``lm_head_on_every_token`` counts the LM head for prompt tokens too (the looser convention of
        "2 x (non-embedding params + LM head) per token"), work an engine that skips prompt logits never does."""
        num_forward = prompt_len + output_len - 1
        attention = 4 * self.num_layers * self.attention_width * num_forward * (num_forward + 1) / 2
        head_rows = num_forward if lm_head_on_every_token else output_len
        return 2 * self.non_embedding_matmul_params * num_forward + attention + 2 * self.lm_head_params * head_rows

    def total(self, requests: RequestSet, lm_head_on_every_token: bool = False) -> float:
        return sum(self.request_flops(n, requests.output_len, lm_head_on_every_token) for n in requests.prompt_lens)


# The CPU flags that decide matmul speed (vector width, FMA, bf16 and int8 dot products, AMX tiles), as
# /proc/cpuinfo spells them.
MATMUL_CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    torch_threads: int
    platform: str
    python: str
    torch: str
    transformers: str
    cpu_flags: list[str] = field(default_factory=list)  # those of MATMUL_CPU_FLAGS the CPU has
    triton: str | None = None  # None: not installed
    # device "cuda": name, capability ("9.0"), memory_gib, cuda (torch's CUDA version), multiprocessors
    gpu: dict[str, Any] | None = None

    @classmethod
    def current(cls, device: str = "cpu") -> Machine:
        """This machine; with ``device`` "cuda", also the current GPU (as ``torch.cuda`` names it)."""
        import importlib.metadata

        import torch
        import transformers

        cpu = platform.processor() or platform.machine()
        try:
            fields = [line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line]
        except OSError:
            fields = []
        names = [value.strip() for key, value in fields if key.strip() == "model name"]
        flag_lists = [value.split() for key, value in fields if key.strip() == "flags"]
        cpu = names[0] if names else cpu
        flags = set(flag_lists[0]) if flag_lists else set()
        try:
            triton: str | None = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton = None
        gpu = None
        if device == "cuda":
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            major, minor = torch.cuda.get_device_capability()
            gpu = {
                "name": torch.cuda.get_device_name(),
                "capability": f"{major}.{minor}",
                "memory_gib": props.total_memory / 2**30,
                "multiprocessors": props.multi_processor_count,
                "cuda": torch.version.cuda,
            }
        return cls(
            cpu=cpu,
            cores=os.cpu_count() or 0,
            torch_threads=torch.get_num_threads(),
            platform=platform.platform(),
            python=platform.python_version(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            cpu_flags=[f for f in MATMUL_CPU_FLAGS if f in flags],
            triton=triton,
            gpu=gpu,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_json(report: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.json`` into ``out_dir`` (made if missing); returns its path and the ``<name>.png`` path
    the report's plot goes to."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    return json_path, png_path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
