"""``splitserve`` command line. Heavy imports (torch, transformers) happen inside the subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from splitserve.base import cpu_threads, envs
from splitserve.base.config_args import add_config_args, config_kwargs_from_args
from splitserve.entrypoints.health import cmd_health

logger = logging.getLogger("splitserve")


MODEL_HELP = "local Hugging Face folder or hub id (default: $SPLITSERVE_MODEL, else the demo model)"


def add_model_args(parser: argparse.ArgumentParser, help_text: str = MODEL_HELP) -> None:
    """The model, as ``vllm serve MODEL`` takes it (positional) or as ``--model``; ``model_from_args`` reads it."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=f"{help_text}; or --model")
    parser.add_argument("--model", default=None, help=help_text)


def model_from_args(args: argparse.Namespace) -> str | None:
    """The model given as MODEL or ``--model`` (None: neither).

    Raises:
        ValueError: both are given and differ.
    """
    positional, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"the model is given twice, as MODEL ({positional}) and as --model ({flag}): give it once")
    return positional if positional is not None else flag


def core_config_from_args(args: argparse.Namespace, model: str) -> Any:
    """The ``CoreConfig`` of ``model`` and the engine flags this command has (others keep their defaults).

    Raises:
        ValueError: a value out of range (``CoreConfig.__post_init__``).
    """
    from core_svc.config import CoreConfig

    return CoreConfig(model=model, **config_kwargs_from_args(args, CoreConfig))


def check_device_arg(args: argparse.Namespace) -> None:
    """``--device cuda`` where torch cannot use a GPU fails here, before anything slow (the model, the demo, the
    server), as a one-line error (``core_svc.device.check_device``; the engine core checks again).

    Raises:
        DeviceUnavailableError: a CPU build of torch, or no GPU visible; the message says which and the fix.
    """
    from core_svc.device import check_device

    check_device(args.device)


def resolve_model_arg(model: str | None, build_demo: bool = True) -> str:
    """MODEL or ``--model``, else ``SPLITSERVE_MODEL``, else the demo model (built on first use when
    ``build_demo``). A model given is checked at once (``model_files.check_model``): a local folder must exist and
    hold a config.json, a hub id must be fetchable (its config.json is downloaded).

    Raises:
        ModelNotFoundError: the model given cannot be served (one line: "no such folder: PATH", "PATH is not a
            model folder: no config.json", the hub could not be reached, ...; "(from $SPLITSERVE_MODEL)" when
            it came from there).
        ValueError: no model given, the demo model is not built, and ``build_demo`` is False.
    """
    from splitserve.base.model_files import ModelNotFoundError, check_model

    if model:
        check_model(model)
        return model
    model = envs.model()
    if model is not None:
        try:
            check_model(model)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"{e} (from $SPLITSERVE_MODEL)") from e
        return model
    from splitserve.entrypoints.demo import demo_model_path

    return str(demo_model_path(build=build_demo))


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from splitserve.entrypoints.test_model import make_test_model

    out = make_test_model(
        args.out, arch=args.arch, preset=args.preset, tokenizer=args.tokenizer, seed=args.seed, dtype=args.dtype
    )
    info = json.loads((out / "splitserve_test_model.json").read_text())
    print(f"wrote {args.arch}/{args.preset} checkpoint ({info['num_parameters']:,} parameters) to {out}")
    return 0


def core_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Engine-core settings for an in-process core (``CoreConfig`` fields other than the model), validated.

    Raises:
        ValueError: a value out of range (``CoreConfig.__post_init__``).
    """
    config = core_config_from_args(args, model="")
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"}


def frontend_config_from_args(args: argparse.Namespace, core_tls: Any = None) -> Any:
    """The ``FrontendConfig`` of this command's flags; the API key also from ``$SPLITSERVE_API_KEY``
    (``api_key_from_args``); ``core_tls``: the frontend's ``ClientTLS`` to its cores, if any.

    Raises:
        ValueError: a value out of range (``FrontendConfig.__post_init__``), a bad API key.
    """
    from frontend_svc.config import FrontendConfig

    kwargs = config_kwargs_from_args(args, FrontendConfig)
    return FrontendConfig(**{**kwargs, "api_key": api_key_from_args(args), "core_tls": core_tls})


# ``CoreConfig`` fields ``generate`` has no flag for: its --seed is each request's sampling seed; no metrics name.
GENERATE_CORE_FIELDS_NOT_FLAGS = ("seed", "served_model_name")
# An unset --max-receive-message-mib: grpc_runtime.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES in MiB (grpc is imported only
# by the commands that serve); a core serving an image model sizes it for its images (core_svc/request_size.py).
DEFAULT_RECEIVE_MIB = 16

# ``generate``'s sampling flags that default to the model's generation config when not given.
DEFAULTABLE_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def cmd_generate(args: argparse.Namespace) -> int:
    from frontend_svc import LLM
    from frontend_svc.generation_config import check_generation_config
    from frontend_svc.sampling_params import sampling_params_with_defaults

    explicit: dict[str, Any] = {
        "n": args.n,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "stop": args.stop,
        "logprobs": args.logprobs,
    }
    explicit.update(
        {name: getattr(args, name) for name in DEFAULTABLE_SAMPLING_FLAGS if getattr(args, name) is not None}
    )
    # Bad flags fail before the model loads; the model's defaults can only be checked with it.
    check_generation_config(args.generation_config)
    sampling_params_with_defaults(explicit, {})
    check_device_arg(args)
    prompts = args.prompt or ["Hello, my name is"]
    model = resolve_model_arg(args.model)
    with LLM(model, generation_config=args.generation_config, **core_kwargs_from_args(args)) as llm:
        # Flags not given take the model's defaults (its generation config), then vLLM's, as a server's requests.
        params = sampling_params_with_defaults(explicit, llm.llm_engine.default_sampling_params)
        if len(prompts) == 1 and params.n == 1 and not args.json:
            _stream_one(llm.llm_engine, prompts[0], params, args.chat)
            return 0
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        if args.json:
            print(json.dumps(_output_json(prompt, output), ensure_ascii=False))
            continue
        for completion in output.outputs:
            label = f"[{completion.index}] " if args.n > 1 else ""
            print(f"{prompt!r} -> {label}{completion.text!r} ({completion.finish_reason})")
    return 0


def _stream_one(engine: Any, prompt: str, params: Any, chat: bool) -> None:
    """Print one completion's text to stdout as the engine releases it, then a newline; log its finish reason and
    speed. The text is the one ``LLM.generate`` returns for the same request (DELTA outputs of one request add up
    to its final text).

    Raises:
        ValidationError, InternalError, EngineDeadError: as ``LLMEngine.add_request`` and ``step``.
    """
    from frontend_svc.sampling_params import RequestOutputKind

    delta = params.clone()
    delta.output_kind = RequestOutputKind.DELTA
    if chat:
        prompt = engine.input_processor.render_chat([{"role": "user", "content": prompt}], True, None)
    start = time.perf_counter()
    engine.add_request("0", prompt, delta)
    num_prompt_tokens = num_output_tokens = 0
    finish_reason = None
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                sys.stdout.write(completion.text)
                sys.stdout.flush()
                num_prompt_tokens = len(output.prompt_token_ids or ())
                num_output_tokens += len(completion.token_ids)
                finish_reason = completion.finish_reason
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    elapsed_s = time.perf_counter() - start
    logger.info(
        "finished (%s): %d prompt tokens, %d output tokens in %.2f s (%.2f toks/s)",
        finish_reason,
        num_prompt_tokens,
        num_output_tokens,
        elapsed_s,
        num_output_tokens / elapsed_s,
    )


def _output_json(prompt: str, output: Any) -> dict[str, Any]:
    completions = []
    for c in output.outputs:
        entry: dict[str, Any] = {
            "index": c.index,
            "token_ids": c.token_ids,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if c.logprobs is not None:
            entry["cumulative_logprob"] = c.cumulative_logprob
            entry["logprobs"] = [
                [
                    {"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in position.items()
                ]
                for position in c.logprobs
            ]
        completions.append(entry)
    return {"prompt": prompt, "prompt_token_ids": output.prompt_token_ids, "outputs": completions}


def add_server_args(parser: argparse.ArgumentParser, default_port: int, receive_default: str | None = None) -> None:
    """The flags both servers take. ``receive_default``: what an unset ``--max-receive-message-mib`` means, for
    its help (None: 16 MiB)."""
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    parser.add_argument("--port", type=int, default=default_port, help="the gRPC port; 0: a free one")
    parser.add_argument(
        "--max-receive-message-mib",
        type=_message_mib,
        default=None,
        help="largest gRPC message taken (requests); a larger one is refused unread with RESOURCE_EXHAUSTED "
        f"(default: {receive_default or f'{DEFAULT_RECEIVE_MIB} MiB'})",
    )
    parser.add_argument(
        "--max-send-message-mib",
        type=_message_mib,
        default=256,
        help="largest gRPC message sent (outputs) (default: %(default)s MiB)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="how long in-flight requests get to finish after SIGTERM (default: %(default)s s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (default: no metrics endpoint)",
    )
    parser.add_argument(
        "--metrics-host", default=None, help="the metrics endpoint's address (default: the same as --host)"
    )
    add_ssl_args(
        parser,
        "",
        "this server's certificate (it then speaks TLS only)",
        "clients must then present a certificate signed by one (mTLS)",
    )


def add_ssl_args(parser: argparse.ArgumentParser, prefix: str, certificate: str, ca: str) -> None:
    """``--{prefix}ssl-keyfile``, ``--{prefix}ssl-certfile``, ``--{prefix}ssl-ca-certs`` (vLLM's names), the
    certificate's and the CA's use told by ``certificate`` and ``ca``."""
    parser.add_argument(f"--{prefix}ssl-keyfile", default=None, help=f"PEM private key of {certificate}")
    parser.add_argument(f"--{prefix}ssl-certfile", default=None, help=f"PEM certificate chain: {certificate}")
    parser.add_argument(f"--{prefix}ssl-ca-certs", default=None, help=f"PEM CA certificates: {ca}")


def server_options_from_args(args: argparse.Namespace) -> Any:
    """The server's ``grpc_runtime.ServerOptions`` from the flags ``add_server_args`` adds.

    Raises:
        ValueError: TLS flags that do not go together.
    """
    from splitserve.base.grpc_runtime import ServerOptions
    from splitserve.base.tls import ServerTLS

    return ServerOptions(
        host=args.host,
        port=args.port,
        message_limits=message_limits_from_args(args),
        shutdown_timeout_s=args.shutdown_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tls=ServerTLS.from_flags(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs),
    )


def add_api_key_arg(parser: argparse.ArgumentParser) -> None:
    """``--api-key``, ``FrontendConfig.api_key``'s flag, for the commands that pass it on (``stack``, ``demo``)."""
    from frontend_svc.config import FrontendConfig

    add_config_args(parser, FrontendConfig, only=("api_key",))


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$SPLITSERVE_API_KEY``, else None (no key).

    Raises:
        ValueError: the one given is empty or no client could send it (``api_key.check_api_key``).
    """
    from splitserve.base.api_key import check_api_key

    if args.api_key is not None:
        return check_api_key(args.api_key, "--api-key")
    key = envs.api_key()
    return check_api_key(key, "SPLITSERVE_API_KEY") if key is not None else None


def _message_mib(value: str) -> float:
    mib = float(value)
    if not 0 < mib * 2**20 < 2**31:
        raise argparse.ArgumentTypeError(f"must be more than 0 and less than 2048 MiB, got {value}")
    return mib


def message_limits_from_args(args: argparse.Namespace) -> Any:
    """The server's ``grpc_runtime.MessageLimits`` from ``--max-receive-message-mib`` / ``--max-send-message-mib``."""
    from splitserve.base.grpc_runtime import MessageLimits

    receive_mib = args.max_receive_message_mib
    return MessageLimits.from_mib(
        DEFAULT_RECEIVE_MIB if receive_mib is None else receive_mib, args.max_send_message_mib
    )


def cmd_core(args: argparse.Namespace) -> int:
    import asyncio

    from core_svc.admin import AdminPolicy
    from core_svc.server import serve_core

    if args.profile_dir is not None and not args.enable_admin_rpcs:
        raise ValueError("--profile-dir is where StartProfile writes: it needs --enable-admin-rpcs")
    options = server_options_from_args(args)
    admin = AdminPolicy.enabled_with(args.profile_dir) if args.enable_admin_rpcs else AdminPolicy()
    check_device_arg(args)
    config = core_config_from_args(args, resolve_model_arg(args.model))
    if args.max_receive_message_mib is None:  # sized for the model's images; the flag, when given, wins
        from core_svc.server import model_message_limits

        options = dataclasses.replace(options, message_limits=model_message_limits(config, options.message_limits))
    return asyncio.run(serve_core(config, options, admin))


def core_tls_from_args(args: argparse.Namespace) -> Any:
    """A frontend's ``ClientTLS`` to its cores: TLS when any ``--core-ssl-*`` flag is given, else None."""
    from splitserve.base.tls import ClientTLS

    flags = (args.core_ssl_ca_certs, args.core_ssl_certfile, args.core_ssl_keyfile, args.core_ssl_server_name)
    if all(value is None for value in flags):
        return None
    if (args.core_ssl_certfile is None) != (args.core_ssl_keyfile is None):
        raise ValueError("--core-ssl-keyfile and --core-ssl-certfile go together")
    return ClientTLS(args.core_ssl_ca_certs, args.core_ssl_certfile, args.core_ssl_keyfile, args.core_ssl_server_name)


def cmd_frontend(args: argparse.Namespace) -> int:
    import asyncio

    from frontend_svc.core_discovery import CoreTarget
    from frontend_svc.generation_config import check_generation_config
    from frontend_svc.server import serve_frontend

    frontend = frontend_config_from_args(args, core_tls_from_args(args))
    cores = [address.strip() for address in args.core.split(",") if address.strip()]
    for address in cores:
        CoreTarget.parse(address)  # a bad one fails here, with its name, before anything starts
    check_generation_config(frontend.generation_config)  # not only once a core answers
    options = server_options_from_args(args)
    return asyncio.run(
        serve_frontend(
            resolve_model_arg(args.model, build_demo=False),  # building it needs torch: the core's job
            cores,
            options,
            frontend,
        )
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from frontend_svc.generation_config import check_generation_config
    from frontend_svc.server import serve_frontend

    frontend = frontend_config_from_args(args)
    check_generation_config(frontend.generation_config)  # not only once the model has loaded
    options = server_options_from_args(args)
    check_device_arg(args)
    # One --served-model-name: the in-process core's metrics report the model by the same name; one
    # --limit-mm-per-prompt, checked by the frontend and the core alike.
    core_config = {
        **core_kwargs_from_args(args),
        "served_model_name": frontend.served_model_name,
        "limit_mm_per_prompt": frontend.limit_mm_per_prompt,
    }
    return asyncio.run(serve_frontend(resolve_model_arg(args.model), None, options, frontend, **core_config))


def cmd_stack(args: argparse.Namespace) -> int:
    """Core and frontend as two processes; with ``demo``, run the demo prompts through them, then stop both."""
    import asyncio
    import signal
    import tempfile

    from splitserve.entrypoints import stack
    from splitserve.entrypoints.demo import model_notice

    tls = stack.StackTLS.from_flags(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)
    api_key = api_key_from_args(args)
    model = resolve_model_arg(args.model)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="splitserve-logs-"))
    print(model_notice(model, args.command), flush=True)
    print(f"starting the split stack (logs in {log_dir})", flush=True)
    core = stack.start_core(model, log_dir, port=args.core_port or None, tls=tls)
    frontend = None
    try:
        core.wait_serving()
        # A key given as a flag goes on as one; from $SPLITSERVE_API_KEY it stays there, for the frontend to read.
        frontend_args = ["--api-key", api_key] if api_key is not None and args.api_key is not None else []
        frontend = stack.start_frontend(model, [core.address], log_dir, frontend_args, args.port or None, tls)
        frontend.wait_serving()
        print(f"core {core.address} and frontend {frontend.address} are SERVING", flush=True)
        if args.command == "demo":
            return asyncio.run(_demo(frontend.address, tls.client() if tls is not None else None, api_key))
        print("Ctrl-C stops both.", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while core.process.poll() is None and frontend.process.poll() is None:
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        codes = [(p.name, p.stop()) for p in (frontend, core) if p is not None]
        print("stopped: " + ", ".join(f"{name} exited {code}" for name, code in codes), flush=True)


async def _demo(address: str, tls: Any, api_key: str | None) -> int:
    from splitserve.entrypoints.demo_client import run_demo

    return await run_demo(address, tls, api_key)


def cmd_build_kernels(args: argparse.Namespace) -> int:
    """Compile the CPU attention kernel ahead of time into ``$SPLITSERVE_CACHE_DIR/kernels``, where cores look
    for it (``make setup`` and the core image run this); exit 1, saying why, when it cannot be built."""
    from kernels.attention.cpu_ops import KernelBuildError, build

    try:
        path, compiled = build(envs.kernel_dir())
    except KernelBuildError as e:
        print(f"cannot build the CPU attention kernel: {e}", file=sys.stderr)
        print(
            "cores on CPU use the slower reference attention backend (torch_ref) until it is built; install a C++ "
            "compiler (g++, or set CXX to one) and run this again",
            file=sys.stderr,
        )
        return 1
    print(f"the CPU attention kernel is {'compiled' if compiled else 'already built'}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``splitserve`` parser; every option's help shows its default (``show_defaults``). The engine's flags are
    ``CoreConfig``'s fields, the frontend's ``FrontendConfig``'s (``splitserve.base.config_args``)."""
    import splitserve
    from core_svc.config import CoreConfig
    from frontend_svc.config import FrontendConfig

    parser = argparse.ArgumentParser(prog="splitserve", description="LLM inference server: gRPC frontend + core")
    parser.add_argument("--version", action="version", version=f"%(prog)s {splitserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from splitserve.entrypoints.test_model import ARCHS, PRESETS

    p = sub.add_parser("make-test-model", help="write a seeded random-weight Hugging Face checkpoint")
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument("--arch", default="llama", choices=ARCHS, help="architecture")
    p.add_argument("--preset", default="tiny", choices=PRESETS, help="size (qwen2.5-0.5b: Qwen2.5-0.5B's shape)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder to copy (default: builtin)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="dtype of the weights (default: the preset's: bfloat16 for qwen2.5-0.5b, else float32)",
    )
    p.set_defaults(func=cmd_make_test_model)

    p = sub.add_parser("generate", help="run prompts offline (the Python API, core in-process)")
    add_model_args(p)
    # --seed is each request's sampling seed here; the engine's RNG keeps its default.
    add_config_args(p, CoreConfig, exclude=GENERATE_CORE_FIELDS_NOT_FLAGS)
    p.add_argument("--prompt", action="append", help="prompt text; repeat for several")
    # Unset by default: the model's generation config fills them, else vLLM's defaults (in brackets).
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate [16]")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy [1.0]")
    p.add_argument("--top-p", type=float, default=None, help="[1.0]")
    p.add_argument("--top-k", type=int, default=None, help="0 or -1 is off [0]")
    p.add_argument("--min-p", type=float, default=None, help="[0.0]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="[1.0]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed of each request")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the EOS token (up to --max-tokens)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=None, help="stop string; repeat for several")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per generated token")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_config_args(p, FrontendConfig, only=("generation_config",))
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("core", help="the engine core as a gRPC server")
    add_model_args(p)
    add_config_args(p, CoreConfig)
    add_server_args(
        p,
        50061,
        f"{DEFAULT_RECEIVE_MIB} MiB, plus room for an image model's pixels: the smaller of --limit-mm-per-prompt of "
        "its largest images and max_model_len - 1 image tokens",
    )
    p.add_argument(
        "--enable-admin-rpcs",
        action="store_true",
        help="allow ResetPrefixCache, StartProfile, StopProfile, Sleep and WakeUp (off: UNIMPLEMENTED) to every "
        "client that reaches the port",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="StartProfile writes only under this directory (default: a new private temporary directory)",
    )
    p.set_defaults(func=cmd_core)

    p = sub.add_parser("frontend", help="the public gRPC API, over one or more engine cores")
    add_model_args(
        p, "the model the cores serve, for its tokenizer (default: $SPLITSERVE_MODEL, else the demo model if built)"
    )
    p.add_argument(
        "--core",
        required=True,
        help="the engine cores: HOST:PORT[,HOST:PORT...], or dns:///NAME:PORT for every address NAME resolves to "
        "(a headless Service), resolved again every 5 s",
    )
    add_server_args(p, 50051)
    add_ssl_args(
        p,
        "core-",
        "the certificate this frontend presents to cores that require one (mTLS)",
        "the cores' certificates must be signed by one (default: the system's roots)",
    )
    p.add_argument(
        "--core-ssl-server-name",
        default=None,
        help="the name the cores' certificates must carry (default: the NAME of dns:///NAME:PORT, else the host)",
    )
    add_config_args(p, FrontendConfig)
    p.set_defaults(func=cmd_frontend)

    p = sub.add_parser("serve", help="the public gRPC API with the engine core in-process")
    add_model_args(p)
    # --served-model-name and --limit-mm-per-prompt are the frontend's, and the in-process core's too (cmd_serve).
    add_config_args(p, CoreConfig, exclude=("served_model_name", "limit_mm_per_prompt"))
    add_server_args(p, 50051)
    add_config_args(p, FrontendConfig)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("health", help="a server's grpc.health.v1 status; exit 0 when SERVING (container checks)")
    p.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the server")
    p.add_argument(
        "--service",
        default="",
        help="'': liveness; splitserve.frontend.v1.Generation or splitserve.engine.v1.EngineCore: readiness",
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, help="how long to wait for the answer (default: %(default)s s)"
    )
    p.add_argument("--tls", action="store_true", help="speak TLS (implied by any --ssl-* flag)")
    add_ssl_args(
        p,
        "",
        "the client certificate, for a server that requires one",
        "the server's certificate must be signed by one (default: the system's roots)",
    )
    p.add_argument(
        "--ssl-server-name", default=None, help="the name the server's certificate must carry (default: the host)"
    )
    p.set_defaults(func=cmd_health)

    for name, text in (
        ("stack", "run core and frontend as two processes until Ctrl-C"),
        ("demo", "start the split stack, stream demo prompts through it, stop it"),
    ):
        p = sub.add_parser(name, help=text)
        add_model_args(p)
        p.add_argument("--port", type=int, default=0, help="frontend port; 0: a free one")
        p.add_argument("--core-port", type=int, default=0, help="core port; 0: a free one")
        p.add_argument("--log-dir", default=None, help="where the two processes log (default: a temporary folder)")
        add_ssl_args(
            p,
            "",
            "both servers' certificate, which the frontend also presents to the core (server and client auth)",
            "signs it; the core requires it of the frontend (mTLS), the frontend and the demo check against it",
        )
        add_api_key_arg(p)
        p.set_defaults(func=cmd_stack)

    p = sub.add_parser("build-kernels", help="compile the CPU attention kernel now, not at a core's first start")
    p.set_defaults(func=cmd_build_kernels)

    from benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    show_defaults(parser)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Add "(default: X)" to the help of every option of ``parser`` and of its subcommands that has a default
    (not None) and does not state one yet. Switches (``store_true`` / ``store_false``) are left as they are:
    off unless given."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)
            continue
        if action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
            continue
        if action.help == argparse.SUPPRESS or "(default" in (action.help or ""):
            continue
        shown = "''" if action.default == "" else "%(default)s"  # help strings are %-formatted by argparse
        action.help = f"{action.help or ''} (default: {shown})".lstrip()


def bind_from_args(args: argparse.Namespace) -> tuple[str, str]:
    """The CPU binding of a command that runs a core and where it came from: ``--cpu-omp-threads-bind``, else
    ``$SPLITSERVE_CPU_OMP_THREADS_BIND``; ``nobind`` for a command without a core (a frontend is never pinned)."""
    if not hasattr(args, "cpu_omp_threads_bind"):
        return "nobind", "SPLITSERVE_CPU_OMP_THREADS_BIND"
    if args.cpu_omp_threads_bind is not None:
        return args.cpu_omp_threads_bind, "--cpu-omp-threads-bind"
    return envs.cpu_omp_threads_bind(), "SPLITSERVE_CPU_OMP_THREADS_BIND"


# The commands that run a server until it is stopped.
SERVER_COMMANDS = (cmd_core, cmd_frontend, cmd_serve)


def end_process(code: int) -> NoReturn:
    """End a server's process once its server has stopped: logs and standard streams flushed, then ``os._exit``,
    skipping the interpreter's teardown of every module and object, which torch and transformers make slow (0.8 s
    of each core's exit on the project's 2-core machine; a rolling update waits for it on every pod). The servers
    shut their tracer providers, exporters and engines down themselves before they return."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> NoReturn:
    """The ``splitserve`` program: ``main`` on the process's arguments, then its exit (``end_process`` once a server
    command has run)."""
    sys.exit(main(owns_process=True))


def main(argv: list[str] | None = None, *, owns_process: bool = False) -> int:
    """Run ``splitserve ARGV``; returns the exit status: 2 and one line on stderr for an error the user can fix
    (a bad flag, a model that cannot be found, a refused setting). ``owns_process``: this call is the process's
    program (``run``): ``frontend`` hides torch from it, and a server command ends it when its server has stopped;
    in-process callers leave it False."""
    args = build_parser().parse_args(argv)
    from splitserve.base.logging_config import LOG_FORMAT

    logging.basicConfig(level=envs.log_level(), format=LOG_FORMAT, stream=sys.stderr)
    # Before any subcommand imports torch: its OpenMP runtime reads the wait policy once, when it is loaded.
    try:
        wait_policy = cpu_threads.prepare_process(envs.omp_wait_policy(), *bind_from_args(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logger.debug("OpenMP wait policy: %s", wait_policy)
    from core_svc.errors import EngineError
    from frontend_svc.errors import FrontendError
    from splitserve.base.model_files import ModelNotFoundError

    try:
        if hasattr(args, "model_tag"):  # MODEL and --model are one setting
            args.model = model_from_args(args)
        if owns_process and args.func is cmd_frontend:
            # The frontend image has no torch; installed beside it, transformers would import it (a slower start).
            # Only where this process is the frontend's: hidden, torch stays hidden for the rest of the process.
            from frontend_svc.without_torch import hide_torch

            hide_torch()
        code = args.func(args)
    except (EngineError, FrontendError, ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if owns_process and args.func in SERVER_COMMANDS:
        end_process(code)
    return code


if __name__ == "__main__":
    run()
