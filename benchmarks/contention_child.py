"""The child process of ``benchmarks.contention``: splitserve float32 on a prompts file's requests, under the wait
policy its environment names (``SPLITSERVE_OMP_WAIT_POLICY``), set before anything loads torch. Prints one JSON
line: output tokens per second, the generate call's wall time, this process's CPU seconds and the policy."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    """The child: splitserve float32 on the prompts file's requests; prints one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("prompts_file", type=Path)
    parser.add_argument("num_threads", type=int)
    args = parser.parse_args(argv)
    from splitserve.base import cpu_threads, envs

    policy_text = cpu_threads.prepare_process(envs.omp_wait_policy())  # before torch is loaded
    from benchmarks.throughput import run_splitserve
    from benchmarks.workload import RequestSet

    data = json.loads(args.prompts_file.read_text())
    requests = RequestSet(prompts=data["prompts"], output_len=data["output_len"], seed=0)
    cpu_start = time.process_time()
    wall, outputs, _ = run_splitserve(args.model, requests, "float32", num_threads=args.num_threads)
    num_out = sum(len(o) for o in outputs)
    print(
        json.dumps(
            {
                "output_tok_s": num_out / wall,
                "generate_wall_s": wall,
                "process_cpu_s": time.process_time() - cpu_start,
                "omp_wait_policy": policy_text,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
