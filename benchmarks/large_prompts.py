"""What large text prompts cost a server before they are refused or tokenized: wall time and the server's peak
memory (RSS, sampled every 10 ms with psutil) per case, against ``splitserve serve`` started from a source tree
(this checkout, or an older one, to compare).

    python -m benchmarks.large_prompts [--source DIR --label TEXT] [--name large-prompts]

Cases (tiny Llama checkpoint with the Llama 2 tokenizer, or the builtin one without it), by max_model_len:
- 2048 (the checkpoint's): a 20 MiB prompt (over the 16 MiB receive limit); a 2 MiB prompt; a 2 MiB Tokenize text;
- 131072: a 6 MiB prompt of emoji (1.5M characters, within what 131071 Llama 2 tokens of up to 16 characters can
  hold; one token per UTF-8 byte under byte fallback, the most tokens a text can have);
- 1048576: a 15 MiB prompt of short words; four 3.9 MiB prompts of words at once; four 3.9 MiB prompts of emoji
  at once.

Each case answers with a gRPC status (a prompt too long for max_model_len is always refused, after tokenizing
or before); what differs is how long and how much memory it takes to get there. Not a test: the numbers depend on
the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from benchmarks.workload import Machine, write_json
from splitserve.entrypoints import stack
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

WORDS = ["the", "of", "and", "a", "to", "in", "is", "you", "that", "it"]


@dataclass
class CaseResult:
    case: str
    answers: list[str]  # each call's status code and the start of its details
    seconds: float
    peak_rss_increase_mib: float


def text_of(num_bytes: int, kind: str = "words") -> str:
    if kind == "emoji":
        return "\U0001f600" * (num_bytes // 4)
    words = " ".join(WORDS[i % len(WORDS)] for i in range(num_bytes // 3))
    return words[:num_bytes]


class PeakRss:
    """The highest RSS of a process while the block runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.base = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def increase_mib(self) -> float:
        return (self.peak - self.base) / 2**20


async def _call(address: str, method: str, text: str) -> str:
    options = [("grpc.max_send_message_length", 2**26)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = api_grpc.GenerationStub(channel)
        try:
            if method == "Tokenize":
                response = await stub.Tokenize(api.TokenizeRequest(text=text), timeout=600)
                return f"OK {len(response.token_ids)} tokens"
            params = api.SamplingParams(max_tokens=1, temperature=0.0)
            async for _ in stub.Generate(api.GenerateRequest(prompt=text, sampling_params=params), timeout=600):
                pass
            return "OK"
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {(e.details() or '')[:90]}"


def run_case(server: stack.ServiceProcess, case: str, calls: list[tuple[str, str]]) -> CaseResult:
    async def all_at_once() -> list[str]:
        return list(await asyncio.gather(*(_call(server.address, method, text) for method, text in calls)))

    with PeakRss(server.process.pid) as rss:
        start = time.perf_counter()
        answers = asyncio.run(all_at_once())
        seconds = time.perf_counter() - start
    result = CaseResult(case, answers, round(seconds, 2), round(rss.increase_mib, 1))
    print(f"{case}: {seconds:.2f} s, peak RSS +{rss.increase_mib:.0f} MiB; {answers[0]}", flush=True)
    return result


def start_server(model: Path, source: Path, log_dir: Path, max_model_len: int | None) -> stack.ServiceProcess:
    args = ["serve", "--model", str(model), "--num-kv-blocks", "64"]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    env = {"PYTHONPATH": str(source), "SPLITSERVE_LOG_STATS_INTERVAL": "0", "OMP_NUM_THREADS": "1"}
    # -P: the source on PYTHONPATH, not the working dir
    launcher = [sys.executable, "-P", "-m", "splitserve.entrypoints.cli"]
    server = stack.start_service(f"serve-{max_model_len}", args, stack.free_port(), log_dir, env=env, launcher=launcher)
    server.wait_serving()
    asyncio.run(_call(server.address, "Generate", "warm up"))
    return server


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1], help="source tree")
    parser.add_argument("--label", default="this checkout", help="what the source tree is, for the results")
    parser.add_argument("--name", default="large-prompts", help="the results' file name")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    from splitserve.entrypoints.test_model import make_test_model

    work = Path(tempfile.mkdtemp(prefix="splitserve-large-prompts-"))
    tokenizers = Path(os.environ.get("SPLITSERVE_TOKENIZERS_DIR", Path(__file__).resolve().parents[2] / "shared"))
    llama2 = tokenizers / "tokenizers" / "llama2"
    tokenizer = llama2 if (llama2 / "tokenizer.json").is_file() else None
    overrides = {"max_position_embeddings": 2**20}
    model = make_test_model(work / "model", "llama", "tiny", tokenizer=tokenizer, config_overrides=overrides)
    cases: list[tuple[int, str, list[tuple[str, str]]]] = [
        (2048, "20 MiB prompt", [("Generate", text_of(20 * 2**20))]),
        (2048, "2 MiB prompt", [("Generate", text_of(2 * 2**20))]),
        (2048, "2 MiB Tokenize text", [("Tokenize", text_of(2 * 2**20))]),
        (131072, "6 MiB emoji prompt", [("Generate", text_of(6 * 2**20, "emoji"))]),
        (2**20, "15 MiB prompt", [("Generate", text_of(15 * 2**20))]),
    ]
    for kind in ("words", "emoji"):
        four = [("Generate", text_of(int(3.9 * 2**20), kind) + f" {i}") for i in range(4)]
        cases.append((2**20, f"4 x 3.9 MiB {kind} prompts at once", four))
    results: list[CaseResult] = []
    for max_model_len, case, calls in cases:  # a fresh server each: memory freed earlier stays in its RSS
        server = start_server(model, args.source, work / "logs", max_model_len)
        try:
            results.append(run_case(server, f"{case}, max_model_len {max_model_len}", calls))
        finally:
            server.stop()
    report = {
        "machine": asdict(Machine.current()),
        "source": args.label,
        "tokenizer": "llama2" if tokenizer else "builtin",
        "cases": [asdict(r) for r in results],
    }
    json_path, _ = write_json(report, args.out, args.name)
    print(f"wrote {json_path}")
    return report


if __name__ == "__main__":
    main()
