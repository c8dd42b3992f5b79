"""The engine core's startup breakdown: its phases, what each made, and the one log line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open

from core_svc.startup import StartupPhase, StartupTimes, process_age_s
from tests.helpers import make_engine


def test_summary_names_every_phase_with_its_note():
    times = StartupTimes(
        before_engine_core_s=2.5, phases=[StartupPhase("kernel", 0.5), StartupPhase("weights", 1.0, "4.8 MiB")]
    )
    assert times.summary() == (
        "engine core ready in 1.50 s (4.00 s since the process started, 2.50 s of it before the engine core: "
        "interpreter, imports, server setup): kernel 0.50 s, weights 1.00 s (4.8 MiB)"
    )
    times.before_engine_core_s = None  # no /proc
    assert times.summary() == "engine core ready in 1.50 s: kernel 0.50 s, weights 1.00 s (4.8 MiB)"


def test_process_age_counts_from_the_process_start():
    start = time.monotonic()
    script = "import time; time.sleep(0.3); from core_svc.startup import process_age_s; print(process_age_s())"
    age = float(subprocess.check_output([sys.executable, "-c", script], text=True))
    elapsed = time.monotonic() - start
    assert 0.3 <= age <= elapsed + 0.01  # 0.01: the start time's resolution (clock ticks)
    assert process_age_s() > age  # this process is older: it ran that one


def test_engine_core_logs_its_startup_breakdown(checkpoint, caplog):
    path = checkpoint("llama")
    with caplog.at_level("INFO", logger="core_svc.engine_core"):
        core = make_engine(path, num_kv_blocks=64)
    phases = core.startup.phases
    # xgrammar is a core dependency: the tokenizer info for structured outputs is built at every start.
    names = ["model files", "model config", "kernel", "weights", "KV cache", "structured outputs"]
    assert [p.name for p in phases] == names
    assert all(p.seconds >= 0 for p in phases)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        checkpoint_bytes = sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118
    assert checkpoint_bytes < 2**30 and phases[3].note == f"{checkpoint_bytes / 2**20:.2f} MiB"
    kv_bytes = sum(cache.nbytes for cache in core.model_runner.kv_caches)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    huge = sys.platform.startswith("linux") and thp.is_file() and "[never]" not in thp.read_text()
    assert kv_bytes < 2**30 and phases[4].note == f"{kv_bytes / 2**20:.2f} MiB" + (", in huge pages" if huge else "")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine core ready in")]
    assert line == core.startup.summary()


def test_loading_and_serving_import_no_compiler_stack(checkpoint):
    """nn.Embedding's random init on the meta device imported torch._dynamo (0.8 s of every start); the model is
    built without it, and a request does not import it either."""
    script = (
        "import sys\n"
        "from core_svc.request import Request\n"
        "from core_svc.sampling_params import SamplingParams\n"
        "from tests.helpers import make_engine\n"
        f"core = make_engine({str(checkpoint('llama'))!r}, num_kv_blocks=64)\n"
        "core.add_request(Request('r', [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0)))\n"
        "while core.has_unfinished_requests():\n"
        "    core.step()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))\n"
    )
    root = Path(__file__).resolve().parents[1]
    assert subprocess.check_output([sys.executable, "-c", script], cwd=root, text=True).strip() == "[]"
