"""``splitserve bench throughput|serve``: argument parsing and the printed summary."""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
logger = logging.getLogger(__name__)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from splitserve.entrypoints.test_model import PRESETS, TEXT_ARCHS

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, online serving latency, large n")
    kinds = bench.add_subparsers(dest="bench", required=True)

    for name, text in (
        ("throughput", "offline throughput against transformers generate and generate_batch, with MFU"),
        ("serve", "latency under a Poisson request rate: split stack against the in-process core"),
    ):
        p = kinds.add_parser(name, help=text)
        p.add_argument("--model", default=None, help="checkpoint folder (default: a seeded make-test-model one)")
        p.add_argument(
            "--arch",
            default=None,
            choices=TEXT_ARCHS if name == "throughput" else (*TEXT_ARCHS, "llava"),
            help="of the built checkpoint (default: llama; llava with --images-per-request)",
        )
        p.add_argument("--preset", default="small", choices=PRESETS, help="qwen2.5-0.5b: Qwen2.5-0.5B's shape")
        p.add_argument(
            "--tokenizer",
            type=Path,
            default=None,
            help="tokenizer folder for the built checkpoint (default: the llama2 tokenizer when present, else builtin)",
        )
        p.add_argument(
            "--num-prompts",
            type=int,
            default=None if name == "throughput" else 32,
            help="requests in the set" + (" (default: 64 on CPU, 512 on CUDA)" if name == "throughput" else ""),
        )
        p.add_argument("--output-len", type=int, default=128 if name == "throughput" else 64)
        p.add_argument("--seed", type=int, default=0, help="seed of the request set")
        p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
        p.add_argument("--name", default=None, help="file name stem (default: <benchmark>-<preset>)")
        if name == "throughput":
            _add_throughput_args(p)
        else:
            p.add_argument(
                "--rates", default="1,inf", help="request rates per second, comma-separated; inf: all at once"
            )
            p.add_argument("--core-args", default="", help="extra flags for the core, e.g. '--max-num-seqs 64'")
            p.add_argument("--repeats", type=int, default=3, help="runs per deployment and rate, interleaved")
            p.add_argument("--log-dir", type=Path, default=None)
            p.add_argument(
                "--api",
                choices=("grpc", "http"),
                default="grpc",
                help="grpc: the split stack against the in-process core, through gRPC; http: one split stack "
                "through its OpenAI-compatible HTTP API against its gRPC API (default: grpc)",
            )
            p.add_argument(
                "--images-per-request",
                type=int,
                default=0,
                help="the image workload: N PNG images per request on a LLaVA checkpoint (built: --arch llava), "
                "and the frontend's preprocessing rate on one thread (0: text only)",
            )
            p.add_argument(
                "--image-sizes",
                default="320x240,640x480,1024x768",
                help="WIDTHxHEIGHT of the images, comma-separated; the requests' images cycle through them",
            )
            p.add_argument(
                "--preprocess-images",
                type=int,
                default=20,
                help="images of each size for the preprocessing rate (with --images-per-request)",
            )
        p.set_defaults(func=cmd_bench)

    p = kinds.add_parser("latency", help="one request at a time: TTFT and ms per output token against the CPU peers")
    p.add_argument("--model", default=None, help="checkpoint folder (default: a seeded make-test-model one)")
    p.add_argument("--arch", default="llama", choices=TEXT_ARCHS)
    p.add_argument("--preset", default="small", choices=PRESETS)
    p.add_argument("--tokenizer", type=Path, default=None, help="as for the other benchmarks")
    p.add_argument("--prompt-lens", default="128,512", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="runs of every engine and prompt length, interleaved")
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16,int8",
        help="splitserve precisions, comma-separated, as bench throughput's",
    )
    p.add_argument(
        "--engines",
        default="splitserve,transformers,ctranslate2,llama.cpp",
        help="comma-separated; ctranslate2 and llama.cpp need the bench extra (skipped with the reason without it)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of every engine (default: the cores this process may use: affinity and cgroup quota)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--peer-precisions",
        default=None,
        help="the peers' precisions to run, comma-separated (e.g. f32,f16,float32,int8; default: all of each)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    p.add_argument("--name", default=None, help="file name stem (default: latency-<preset>)")
    p.set_defaults(func=cmd_bench)

    p = kinds.add_parser("embed", help="embeddings per second: LLM.embed against transformers AutoModel batched")
    p.add_argument("--model", default=None, help="checkpoint folder (default: a seeded make-test-model one)")
    p.add_argument("--arch", default="llama", choices=TEXT_ARCHS)
    p.add_argument("--preset", default="small", choices=PRESETS)
    p.add_argument("--tokenizer", type=Path, default=None, help="as for the other benchmarks")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts of the standard set")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (best reported)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    p.add_argument("--seed", type=int, default=0, help="seed of the request set")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--name", default=None, help="file name stem (default: embed-<preset>)")
    p.set_defaults(func=cmd_bench)

    p = kinds.add_parser("n", help="one request with a large n: add, first output, abort after a deadline, liveness")
    p.add_argument("--model", default=None, help="checkpoint folder (default: a seeded make-test-model one)")
    p.add_argument("--arch", default="llama", choices=TEXT_ARCHS)
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument("--tokenizer", type=Path, default=None, help="as for the other benchmarks")
    p.add_argument("--ns", default="1024,4096,16384", help="values of n, comma-separated")
    p.add_argument("--deadline-s", type=float, default=10.0, help="the client's deadline (issue 13 used 10 s)")
    p.add_argument("--max-tokens", type=int, default=2000, help="per completion, EOS ignored: outlasts the deadline")
    p.add_argument("--deployments", default="split,in-process", help="comma-separated: split, in-process")
    p.add_argument("--repeats", type=int, default=3, help="runs of each deployment and n (medians reported)")
    p.add_argument("--max-wait-s", type=float, default=900.0, help="give up on an abort after this long")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    p.add_argument("--name", default=None, help="file name stem (default: n-<preset>)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--baseline", type=Path, default=None, help="an earlier bench n JSON to show beside this run")
    p.set_defaults(func=cmd_bench)


def _add_throughput_args(p: argparse.ArgumentParser) -> None:
    """The throughput benchmark's own flags; those whose default depends on the device default to None
    (``throughput.Settings.for_device`` fills them)."""
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where every backend runs; cuda also measures the single-request ITL against the weight-read bound",
    )
    p.add_argument(
        "--backends",
        default="splitserve,hf-generate,hf-generate-batch",
        help="comma-separated: splitserve, hf-generate, hf-generate-batch, ctranslate2, llama.cpp (the last two "
        "need the bench extra; skipped with the reason without it)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of every backend (default: the cores this process may use: affinity and cgroup quota)",
    )
    p.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="also run splitserve float32 alone and beside N busy processes on its cores, under each OpenMP "
        "wait policy: the runtime's default, passive, and splitserve's short spin (0: skip)",
    )
    p.add_argument("--contend-num-prompts", type=int, default=16, help="requests of each contention run")
    p.add_argument(
        "--contend-timeout-s", type=float, default=600.0, help="a contention run still going then is stopped"
    )
    p.add_argument(
        "--dtypes",
        default=None,
        help="splitserve precisions, comma-separated: a dtype; int8: --quantization int8; float32-dense, "
        "bfloat16-dense: --dense-decode-weights; any with -kv-bfloat16 or -kv-float32 (float32-kv-bfloat16, "
        "int8-kv-float32): that --kv-cache-dtype (default: float32,bfloat16,int8; cuda: bfloat16)",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=None,
        help="runs of each splitserve precision, interleaved in a Williams order: each one's median run in the "
        "table, the ratios between precisions the median of their ratios round by round (default: 1)",
    )
    p.add_argument("--hf-dtype", default=None, help="transformers' dtype (default: float32; cuda: bfloat16)")
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="static batch size of transformers generate (16; cuda: 64)"
    )
    p.add_argument(
        "--preemption-kv-fraction",
        type=float,
        default=None,
        help="also run splitserve with a KV cache this fraction of the set's need (0: skip; default 0.25, cuda: 0)",
    )
    p.add_argument(
        "--observability-repeats",
        type=int,
        default=None,
        help="runs of splitserve with tracing and metrics off and on, alternating, to measure their cost "
        "(0: skip; default 3, cuda: 0)",
    )
    p.add_argument(
        "--single-request-output-len",
        type=int,
        default=None,
        help="output tokens of the single-request ITL run against the weight-read bound (0: skip; default 0, "
        "cuda: 128)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="splitserve's --max-num-seqs (default: the core's)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="splitserve's --gpu-memory-utilization on cuda (default: the core's)",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="splitserve without CUDA graphs (default: with them, on cuda)"
    )
    p.add_argument(
        "--structured-outputs",
        action="store_true",
        help="instead: splitserve alone, every request unconstrained against every other one under a JSON schema "
        "(benchmarks/structured_outputs.py)",
    )
    p.add_argument(
        "--loras",
        type=int,
        default=0,
        metavar="N",
        help="instead: splitserve alone, the base model against N random rank-16 LoRA adapters spread over the "
        "requests, all in the same batches (benchmarks/lora.py)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _throughput_settings(args: argparse.Namespace) -> Any:
    from benchmarks import throughput

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())

    core_config: dict[str, Any] = {}
    if args.max_num_seqs is not None:
        core_config["max_num_seqs"] = args.max_num_seqs
    if args.gpu_memory_utilization is not None:
        core_config["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        core_config["enforce_eager"] = True
    return throughput.Settings.for_device(
        args.device,
        backends=names(args.backends),
        dtypes=names(args.dtypes),
        rounds=args.rounds,
        hf_dtype=args.hf_dtype,
        hf_batch_size=args.hf_batch_size,
        preemption_kv_fraction=args.preemption_kv_fraction,
        observability_repeats=args.observability_repeats,
        single_request_output_len=args.single_request_output_len,
        core_config=core_config,
        num_threads=args.num_threads,
        contend=args.contend,
        contend_num_prompts=args.contend_num_prompts,
        contend_timeout_s=args.contend_timeout_s,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from benchmarks import workload

    if args.model:
        model = Path(args.model)
    else:
        tokenizer_dir = args.tokenizer or workload.default_tokenizer_dir()
        if tokenizer_dir is None:
            logger.warning("no llama2 tokenizer found (SPLITSERVE_TOKENIZERS_DIR): using the builtin tokenizer")
        arch = args.arch or ("llava" if getattr(args, "images_per_request", 0) else "llama")
        model = workload.bench_model_path(arch, args.preset, tokenizer_dir)
    if args.bench == "n":
        return _bench_n(args, model)
    if args.bench == "latency":
        return _bench_latency(args, model)
    if args.bench == "embed":
        return _bench_embed(args, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    num_prompts = args.num_prompts or (512 if getattr(args, "device", "cpu") == "cuda" else 64)
    images_per_request = getattr(args, "images_per_request", 0)
    if images_per_request:
        from benchmarks import image_workload

        sizes = image_workload.parse_image_sizes(args.image_sizes)
        requests = image_workload.make_image_request_set(
            num_prompts, args.output_len, tokenizer, images_per_request, sizes, args.seed
        )
    else:
        requests = workload.make_request_set(num_prompts, args.output_len, tokenizer, args.seed)
    kind = f"{args.bench}-images" if images_per_request else args.bench
    if getattr(args, "api", "grpc") == "http":
        kind = f"{kind}-http"
    name = args.name or f"{kind}-{args.preset if not args.model else model.name}"
    if args.bench == "throughput" and args.structured_outputs:
        from benchmarks import structured_outputs

        report = structured_outputs.run(model, requests)
        json_path = structured_outputs.write_report(
            report, args.out, args.name or f"throughput-structured-{args.preset}"
        )
        print(structured_outputs.format_report(report))
        print(f"wrote {json_path}")
        return 0
    if args.bench == "throughput" and args.loras:
        from benchmarks import lora

        report = lora.run(model, requests, args.loras, Path(tempfile.mkdtemp(prefix="splitserve-loras-")))
        json_path = lora.write_report(report, args.out, args.name or f"throughput-loras-{args.preset}")
        print(lora.format_report(report))
        print(f"wrote {json_path}")
        return 0
    if args.bench == "throughput":
        from benchmarks import throughput, throughput_report

        report = throughput.run(model, requests, _throughput_settings(args))
        json_path, png_path = throughput_report.write_report(report, args.out, name)
        text = throughput_report.format_report(report)
    else:
        from benchmarks import serve

        rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",") if r.strip()]
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="splitserve-bench-"))
        run = serve.run_http if args.api == "http" else serve.run
        report = run(model, requests, rates, args.core_args.split(), log_dir, args.repeats)
        if images_per_request:
            report["preprocessing"] = image_workload.preprocess_rate(model, sizes, args.preprocess_images, args.seed)
        json_path, png_path = serve.write_report(report, args.out, name)
        text = serve.format_report(report)
    print(text)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _bench_n(args: argparse.Namespace, model: Path) -> int:
    from benchmarks import large_n

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="splitserve-bench-"))
    settings = large_n.Settings(
        ns=tuple(int(n) for n in args.ns.split(",") if n.strip()),
        deadline_s=args.deadline_s,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        max_wait_s=args.max_wait_s,
    )
    deployments = [d.strip() for d in args.deployments.split(",") if d.strip()]
    report = large_n.run(model, settings, deployments, log_dir, args.baseline)
    name = args.name or f"n-{args.preset if not args.model else model.name}"
    json_path, png_path = large_n.write_report(report, args.out, name)
    print(large_n.format_report(report))
    print(f"wrote {json_path} and {png_path}")
    return 0


def _bench_latency(args: argparse.Namespace, model: Path) -> int:
    from transformers import AutoTokenizer

    from benchmarks import latency
    from splitserve.base import cpu_threads

    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    settings = latency.Settings(
        prompt_lens=tuple(int(n) for n in names(args.prompt_lens)),
        output_len=args.output_len,
        repeats=args.repeats,
        dtypes=names(args.dtypes),
        engines=names(args.engines),
        num_threads=cpu_threads.detect_threads(args.num_threads).num_threads,
        seed=args.seed,
        peer_precisions=names(args.peer_precisions) if args.peer_precisions else None,
    )
    report = latency.run(model, AutoTokenizer.from_pretrained(model), settings)
    name = args.name or f"latency-{args.preset if not args.model else model.name}"
    json_path, png_path = latency.write_report(report, args.out, name)
    print(latency.format_report(report))
    print(f"wrote {json_path} and {png_path}")
    return 0


def _bench_embed(args: argparse.Namespace, model: Path) -> int:
    from transformers import AutoTokenizer

    from benchmarks import embed, workload

    requests = workload.make_request_set(args.num_prompts, 1, AutoTokenizer.from_pretrained(model), args.seed)
    report = embed.run(model, requests, args.repeats, args.hf_batch_size)
    json_path = embed.write_report(
        report, args.out, args.name or f"embed-{args.preset if not args.model else model.name}"
    )
    print(embed.format_report(report))
    print(f"wrote {json_path}")
    return 0
