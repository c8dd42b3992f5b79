"""Which dtype a CPU core computes in: a 16-bit dtype only where the CPU has arithmetic for it.

Without native bfloat16 (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo), torch and oneDNN emulate it: on an
AVX2 machine the issue measured ``dtype="bfloat16"`` at 0.24x float32's batch throughput. Keeping 16-bit weights
and converting them to float32 per matmul is no better: measured here with torch's, oneDNN's and MKL's dispatch
held to AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``), a [2816, 512]
projection took 1.6 ms at 1 row and 6.7 ms at 64 rows that way against float32's 0.7 and 6.6 ms, and bfloat16
matmuls took 0.6 and 35.5 ms. So on such a CPU the core warns and loads float32 (float16 likewise, needing
``avx512_fp16`` or ``amx_fp16``), and its warning names what compresses there: ``--quantization int8``, faster than
float32 where the CPU has int8 dot products (VNNI, AMX) and, through the compiled AVX2 int8 kernel, where it has
AVX2 without them (on an AMD Zen 3: 1.1-1.3x float32's batch throughput, 0.34-0.42x its time per token for one
request; docs/benchmarks.md, "float32 panels on AVX2"); ``--kv-cache-dtype bfloat16`` for the KV cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

# dtype -> the /proc/cpuinfo flags any one of which gives the CPU arithmetic in it
NATIVE_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
# the flags of int8 dot-product instructions: oneDNN's int8 product (exact and fast) and int8_gemv run on them;
# without them int8 takes the AVX2 kernel (core_svc.models.quantization.has_int8_dot_products)
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's ``flags`` line of ``cpuinfo``; empty where there is none (not Linux x86)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_compute_dtype(requested: torch.dtype, flags: frozenset[str]) -> tuple[torch.dtype, str | None]:
    """The dtype to load a CPU model in when ``requested`` is asked for on a CPU with ``flags`` (``cpu_flags``),
    and the warning to log when it is not ``requested``: float32 in place of a 16-bit dtype the CPU has no
    arithmetic for. Where ``flags`` is empty (unknown CPU) the request stands."""
    needed = NATIVE_FLAGS.get(requested)
    if needed is None or not flags or any(f in flags for f in needed):
        return requested, None
    name = str(requested).removeprefix("torch.")
    if any(f in flags for f in NATIVE_FLAGS[torch.bfloat16]):  # float16 asked for on a CPU with bfloat16
        instead = "--dtype bfloat16 runs in 16 bits on this CPU"
    elif flags & INT8_DOT_FLAGS:
        instead = "--quantization int8 compresses the weights and runs faster than float32 on this CPU"
    elif "avx2" in flags:
        instead = (
            "--quantization int8 compresses the weights and runs faster than float32 on this CPU (through the "
            "compiled AVX2 int8 kernel)"
        )
    else:
        instead = "--quantization int8 compresses the weights on this CPU"
    return torch.float32, (
        f"dtype {name} asked for, but this CPU has no {name} arithmetic (none of the flags {', '.join(needed)}): "
        f"torch would emulate it at a fraction of float32's speed, so the model runs in float32 instead; "
        f"{instead}; --kv-cache-dtype bfloat16 halves the KV cache"
    )
