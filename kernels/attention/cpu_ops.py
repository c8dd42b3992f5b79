"""Builds and loads the C++ CPU kernels (``csrc/``): one binary per build key.

``load(build_dir)`` compiles ``csrc/*.cpp`` (``_SOURCES``) the first time (the C++ compiler, ``$CXX`` or else
``c++``, once per source, as many at once as the process may use CPUs, then a link; about 40 s on 2 cores) into
``build_dir/splitserve_cpu_<key>.so`` and loads it with ``torch.ops.load_library``, which registers
``torch.ops.splitserve_cpu.*``. The key is a hash of everything the binary depends on: the sources, the flags,
the compiler (its path and ``--version``), torch's version and C++ ABI, and the CPU's feature flags
(``-march=native``). A later load, in any process, finds the file by its key and does not compile, whichever ninja
or virtualenv is on PATH; a change of any input gives another key, so another file, built once beside the first.

Why not ``torch.utils.cpp_extension.load``: its ninja build decides whether to rebuild from the ninja command line
it records, which holds the virtualenv's paths and depends on which ninja runs it (the system's or the wheel's),
so processes started with and without an activated virtualenv rebuilt in turn (12-25 s each here, 70-125 s on a
busy 2-core machine), and a build killed half-way left a state that was then reported as a failed build.

Builds are atomic and serialized. The compiler writes a temporary file in the same folder, which is renamed into
place only when complete, so a killed build leaves nothing that is later loaded (its temporary file is removed by
the next build). An exclusive ``flock`` on ``<name>.lock`` beside the binary makes concurrent processes compile once:
the others wait, then load what it built.

Environment: ``CXX`` (the compiler command, as torch's extension builder reads it). The folder is the caller's:
the engine core passes ``$SPLITSERVE_CACHE_DIR/kernels`` (``splitserve.base.envs.kernel_dir``), and ``splitserve
build-kernels`` builds there ahead of time.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from kernels.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

# Longest compile first (on 2 cores the build takes about as long as its longest chain of compiles; the test
# suite's fake compilers expect paged_attention_cpu.cpp first): paged decode attention; paged prefill attention; a
# decode step of a few rows through a whole decoder, calling the others through cpu_ops.h
# (core_svc/models/one_call_decoder.py); every op's schema (with decoder_cpu.cpp, the only source that includes
# torch/library.h); bfloat16 products of many rows on AMX over the dense weight (core_svc/models/layers.py); a
# decoder layer's elementwise work between its products, float32 products of many rows over the weight in panels,
# and one request's matrix-vector products (core_svc/models/layers.py); the row passes around int8 matmuls
# (core_svc/models/quantization.py); int8 products over the weight in panels on CPUs without AVX-512 VNNI
# (core_svc/models/quantization.py); the greedy token of each row (core_svc/sampler.py)
_SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention_cpu.cpp",
        "prefill_attention_cpu.cpp",
        "decoder_cpu.cpp",
        "registration_cpu.cpp",
        "amx_linear_cpu.cpp",
        "layer_ops_cpu.cpp",
        "panel_linear_cpu.cpp",
        "gemv_cpu.cpp",
        "int8_rows_cpu.cpp",
        "int8_panel_linear_cpu.cpp",
        "argmax_cpu.cpp",
    )
)
_HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("cpu_ops.h", "attention_common.h"))
_SOURCE_NAMES = ", ".join(source.name for source in _SOURCES)
_LIBRARY_PREFIX = "splitserve_cpu_"
# -march=native: the build happens on the machine that runs it (the key holds the CPU's flags). -fopenmp: the
# kernel's OpenMP pragmas, resolved against the OpenMP runtime torch has already loaded. The rest are the flags
# torch's extension builder (2.13) uses for a CPU library, and -fno-trapping-math: no source reads floating-point
# exception flags, and without it GCC left loops with a comparison unvectorized on AVX2 (the clamp in SiLU's exp:
# "control flow in loop"), where AVX-512's masks had let it through: silu_and_mul took 10 ns per value on a Zen 3.
# The values are unchanged. A source's `#pragma GCC optimize("no-unsafe-math-optimizations")` turns trapping math
# back on, so those pragmas name "no-trapping-math" too.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20", "-shared", "-fno-trapping-math"]
# -ffast-math for the attention kernels only: reassociated (vectorized) sums over finite scores; their softmax's exp
# is their own (attention_common.h's exp_nonpositive), since glibc's vector expf goes scalar for a vector with a lane
# below -87. The other sources round as torch's operators do (and their own pragmas also keep products and sums
# apart); under -ffast-math GCC had replaced a division by a product with the reciprocal and called libmvec's expf,
# up to 4 ulps from torch's SiLU.
_FAST_MATH_SOURCES = ("paged_attention_cpu.cpp", "prefill_attention_cpu.cpp")
_FAST_MATH = "-ffast-math"
_COMPILE_TIMEOUT_S = 900
_ERROR_TAIL_LINES = 20


INSTALL_A_COMPILER = (
    "install a C++ compiler (g++, or set CXX to one) and restart, which builds the kernel once (about 40 s)"
)


class KernelBuildError(RuntimeError):
    """The kernel cannot be built or loaded. ``reason`` says why in one line (no compiler, the compile failed,
    the binary did not load); ``details``, also at the end of the message, the compiler's command and last lines
    where there are some; ``fix``, what to do about this reason."""

    def __init__(self, reason: str, details: str = "", fix: str = INSTALL_A_COMPILER) -> None:
        super().__init__(f"{reason}\n{details}" if details else reason)
        self.reason = reason
        self.details = details
        self.fix = fix


def load(build_dir: Path) -> Path:
    """Compile (the first time for this key) and load the kernels, registering ``torch.ops.splitserve_cpu.*``.
    Once per process and folder: a later call returns the first call's result, a failure included (a failed
    build costs seconds). The ops are registered once per process; a load from a second folder builds there if
    needed but keeps the first registration.

    Args:
        build_dir: where binaries are kept (created when missing); the engine core passes
            ``$SPLITSERVE_CACHE_DIR/kernels``.

    Returns:
        The loaded binary's path.

    Raises:
        KernelBuildError: no C++ compiler, the compile failed (the message ends with the compiler's last lines),
            the folder is not writable, or the binary does not load.
    """
    result = _load(_resolve(build_dir))
    if isinstance(result, KernelBuildError):
        raise result
    return result


def build(build_dir: Path) -> tuple[Path, bool]:
    """Compile the kernels unless a binary for this key is already in ``build_dir``, without loading them (the
    ahead-of-time build, ``splitserve build-kernels``).

    Returns:
        ``(path, compiled)``: the binary, and whether this call compiled it (False: it was there, or another
        process built it while this one waited).

    Raises:
        KernelBuildError: as ``load``.
    """
    build_dir = _resolve(build_dir)
    spec = _build_spec()
    path = build_dir / f"{_LIBRARY_PREFIX}{spec.key}.so"
    if path.is_file():
        return path, False
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            _lock(lock, path)
            if path.is_file():  # another process built it while this one waited
                return path, False
            _compile(spec, path)
    except OSError as e:
        raise KernelBuildError(
            f"cannot write the CPU attention kernel into {build_dir}: {e}",
            fix=f"make {build_dir} writable, or set SPLITSERVE_CACHE_DIR to a writable folder, and restart",
        ) from e
    return path, True


@functools.cache
def _load(build_dir: Path) -> Path | KernelBuildError:
    try:
        path, _ = build(build_dir)
    except KernelBuildError as e:
        return e
    if hasattr(torch.ops.splitserve_cpu, "paged_decode_attention"):
        logger.info("the CPU attention kernel is already loaded in this process; not loading %s", path)
        return path
    flushed_before = _denormals_flushed()
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        return KernelBuildError(
            f"cannot load the CPU attention kernel {path}: {e}", fix=f"remove {path}, which is then built again"
        )
    if _denormals_flushed() and not flushed_before:
        # GCC (12 here) links crtfastmath.o into a -ffast-math shared library, whose constructor set the loading
        # thread's flush-to-zero and denormals-are-zero bits: torch.tensor(1e-39) * 1 became 0 (found in review).
        torch.set_flush_denormal(False)
    built = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    logger.info("loaded the CPU attention kernel from %s (built %s)", path, built)
    return path


def _resolve(build_dir: Path) -> Path:
    return build_dir.expanduser().absolute()


@dataclass(frozen=True)
class _BuildSpec:
    """The compiler command, its flags, and the key of the binary they make here."""

    cxx: list[str]
    cflags: list[str]
    key: str


def _build_spec() -> _BuildSpec:
    """Raises KernelBuildError when the compiler cannot be found or run."""
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    compiler = shutil.which(cxx[0]) if cxx else None
    if compiler is None:
        named = f"CXX={os.environ['CXX']!r} is not an executable" if os.environ.get("CXX") else "no c++ on PATH"
        raise KernelBuildError(f"no C++ compiler: {named}")
    try:
        version = subprocess.run(
            [*cxx, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the C++ compiler {compiler} does not run: {e}") from e
    cflags = [*_CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    inputs = {
        "source_sha256": [hashlib.sha256(source.read_bytes()).hexdigest() for source in (*_SOURCES, *_HEADERS)],
        "cflags": cflags,
        "fast_math_sources": list(_FAST_MATH_SOURCES),
        "cxx": cxx,
        "compiler": os.path.realpath(compiler),
        "compiler_version": version,
        "torch": torch.__version__,
        "cpu": _cpu_signature(),
    }
    # The paths of torch's headers and libraries are left out: a torch version has the same in every virtualenv.
    return _BuildSpec(cxx, cflags, hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16])


def _denormals_flushed() -> bool:
    """Whether this thread's float arithmetic flushes subnormal results to zero."""
    return float(torch.tensor(1e-39, dtype=torch.float32) * 1.0) == 0.0


def _lock(lock: IO[str], path: Path) -> None:
    """Take the build lock of ``path``, saying so when another process holds it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.info("waiting for another process's build of the CPU attention kernel: %s", path)
        fcntl.flock(lock, fcntl.LOCK_EX)


def _compile(spec: _BuildSpec, path: Path) -> None:
    """Compile into a temporary file beside ``path`` and rename it into place; call with the build lock held.
    Each source is compiled on its own, as many at once as the process has CPUs, then the objects are linked."""
    from torch.utils import cpp_extension  # 0.25 s of imports: only when compiling

    for stale in path.parent.glob(f".{path.name}.*.tmp*"):  # of builds killed half-way: none runs, we hold the lock
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    objects = [tmp.with_name(f"{tmp.name}.{source.stem}.o") for source in _SOURCES]
    includes = [f"-isystem{include}" for include in cpp_extension.include_paths("cpu")]
    compiles = [
        [*spec.cxx, *spec.cflags, *_source_flags(source), *includes, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(_SOURCES, objects, strict=True)
    ]
    link = [
        *spec.cxx,
        *spec.cflags,
        *(str(obj) for obj in objects),
        "-o",
        str(tmp),
        *(f"-L{lib}" for lib in cpp_extension.library_paths("cpu")),
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
    ]
    logger.info("compiling the CPU attention kernel (first use of this build, about 40 s on 2 cores): %s", path)
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(len(compiles), _usable_cpus()))) as pool:
            for source, command, result in zip(_SOURCES, compiles, pool.map(_run_compiler, compiles), strict=True):
                _check(f"compiling {source.name}", command, result)
        _check(f"linking {_SOURCE_NAMES}", link, _run_compiler(link))
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, *objects):
            leftover.unlink(missing_ok=True)
    logger.info("compiled the CPU attention kernel in %.1f s: %s", time.perf_counter() - start, path)


def _source_flags(source: Path) -> list[str]:
    return [_FAST_MATH] if source.name in _FAST_MATH_SOURCES else []


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one), for parallel compiles: the rule
    of ``splitserve.base.cpu_threads.affinity_cpus``, which ``kernels`` may not import (.importlinter)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check(step: str, command: list[str], result: subprocess.CompletedProcess[str]) -> None:
    """Raises KernelBuildError, naming ``step`` and with the compiler's last lines, when ``command`` failed."""
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-_ERROR_TAIL_LINES:])
        raise KernelBuildError(
            f"{step} failed (exit {result.returncode}); the compiler's last lines: "
            f"{' | '.join(tail.splitlines()[-3:])}",
            f"command: {shlex.join(command)}\n{tail}",
            fix="read the compiler's output (logged below); set CXX to another C++ compiler (g++ 9 or newer) "
            "and restart",
        )


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run the compile; its output (stdout and stderr together) in ``stdout``. Raises KernelBuildError when it
    cannot run or takes more than ``_COMPILE_TIMEOUT_S``."""
    try:
        return subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=_COMPILE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        raise KernelBuildError(
            f"compiling {_SOURCE_NAMES} took more than {_COMPILE_TIMEOUT_S} s",
            fix="build it ahead of time, when the machine is less busy (splitserve build-kernels), and restart",
        ) from e
    except OSError as e:  # the compiler went away since its --version answered
        raise KernelBuildError(f"cannot run the C++ compiler {command[0]}: {e}") from e


def _cpu_signature() -> str:
    """A short hash of the machine type and the CPU flags /proc/cpuinfo lists (the machine type alone elsewhere)."""
    text = platform.machine()
    try:
        text += next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))
        )
    except (OSError, StopIteration):
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def loaded_ops() -> Any:
    """``torch.ops.splitserve_cpu`` once this process has loaded the kernels (``load``; the CPU attention backend
    does when an engine starts), else None. Its ops beside attention: ``gemv`` and ``gemv_available``
    (``csrc/gemv_cpu.cpp``), ``add_rms_norm``, ``rotary_in_place`` and ``silu_and_mul`` (``csrc/layer_ops_cpu.cpp``),
    ``int8_gemv``, ``quantize_rows_int8`` and ``dequantize_rows`` (``csrc/int8_rows_cpu.cpp``), ``argmax_rows``
    (``csrc/argmax_cpu.cpp``), ``amx_linear`` and ``amx_linear_available`` (``csrc/amx_linear_cpu.cpp``),
    ``panel_linear`` and ``panel_linear_available`` (``csrc/panel_linear_cpu.cpp``)."""
    global _LOADED_OPS
    if _LOADED_OPS is None:
        try:
            torch.ops.splitserve_cpu.paged_decode_attention  # noqa: B018  (raises while the library is not loaded)
        except (AttributeError, RuntimeError):
            return None
        _LOADED_OPS = torch.ops.splitserve_cpu
    return _LOADED_OPS


_LOADED_OPS: Any = None


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Attention of one query token per request over its paged keys and values, written into ``out``.

    Args:
        out, query: ``[num_reqs, num_heads, head_size]``, float32, bfloat16 or float16 (scores and sums are
            float32); ``out`` contiguous, ``query`` contiguous within each row (a view of a fused q/k/v projection
            is fine).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous, in the query's
            dtype or, under float32 queries, bfloat16 or float16 (``--kv-cache-dtype``; widened as read).
        block_table: ``[num_reqs, max_blocks]`` int32; seq_lens: ``[num_reqs]`` int32, at least 1.
        sliding_window: keys at positions > seq_len - 1 - W only; None for full attention.

    Raises:
        RuntimeError: shapes, strides or dtypes other than these, each named.
    """
    torch.ops.splitserve_cpu.paged_decode_attention(
        out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window or 0
    )


def decode_attention_with_kv_write(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """``paged_decode_attention`` of a decode-only batch after storing each request's new key and value in its slot:
    one call per layer in place of the KV write's index copies and the attention.

    Args:
        key, value: ``[num_reqs, num_kv_heads, head_size]``, the query's dtype, contiguous within each head (a view
            of a fused q/k/v projection is fine); stored rounded to nearest even where the cache is narrower.
        slot_mapping: ``[>= num_reqs]`` int64, the slot of each request's new token.
        the rest: as ``paged_decode_attention``.
    """
    torch.ops.splitserve_cpu.decode_attention_with_kv_write(
        out, query, key, value, key_cache, value_cache, slot_mapping, block_table, seq_lens, scale, sliding_window or 0
    )


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Causal attention of the prefill requests' query tokens (``metadata``'s requests from ``num_decodes`` on: a
    whole prompt, or a chunk after cached tokens) over their paged keys and values, which this step's must already
    hold, written into their rows of ``out``: FlashAttention's online softmax over tiles of query rows and chunks of
    slots read in place (``csrc/prefill_attention_cpu.cpp``).

    Args:
        out, query: ``[num_tokens, num_heads, head_size]``, float32, bfloat16 or float16 (scores and sums are
            float32); ``out`` contiguous, ``query`` contiguous within each row (a view of a fused q/k/v projection
            is fine). The decode rows of ``out`` are left as they are.
        key_cache, value_cache: as ``paged_decode_attention``'s.
        metadata: the step's ``query_start_loc``, ``seq_lens`` and ``block_table`` (int32 CPU tensors).
        sliding_window: keys at positions > p - W only for a query at position p; None for full attention.

    Raises:
        RuntimeError: shapes, strides or dtypes other than these, or a request whose lengths its block table row
            cannot hold, each named.
    """
    torch.ops.splitserve_cpu.paged_prefill_attention(
        out,
        query,
        key_cache,
        value_cache,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.num_decodes,
        scale,
        sliding_window or 0,
    )
