"""The frontend's configuration: what only a frontend (or ``serve``) is started with, besides where it listens
(``splitserve.base.grpc_runtime.ServerOptions``). Its flags are generated from the fields
(``splitserve.base.config_args``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from frontend_svc.chat_content_format import CONTENT_FORMATS
from frontend_svc.reasoning import REASONING_PARSERS
from frontend_svc.sampling_params import MAX_N
from frontend_svc.tool_calls import TOOL_CALL_PARSERS
from splitserve.base.config_args import NOT_A_FLAG, flag
from splitserve.base.mm_limits import DEFAULT_LIMIT_PER_PROMPT, parse_limit_mm_per_prompt
from splitserve.base.tls import ClientTLS

# Where a frontend (or ``serve``) reports --served-model-name.
PUBLIC_MODEL_NAME = "GetModelInfo's model, the metrics' model_name label, the gen_ai.response.model of traces"


@dataclass(frozen=True)
class FrontendConfig:
    """Everything ``splitserve frontend`` / ``serve`` is started with but the model, its cores and its address.

    Raises:
        ValueError: from ``__post_init__``, naming the field, for a value out of range.
    """

    # Whether a Chat call may bring its own template (as vLLM's flag).
    trust_request_chat_template: bool = field(
        default=False,
        metadata=flag("let Chat calls bring their own chat_template (it runs on the frontend's CPU)"),
    )
    # The chat template of chat requests that bring none (vLLM's --chat-template): a file, or the template itself.
    chat_template: str | None = field(
        default=None,
        metadata=flag(
            "the chat template of every chat request that brings none, as vLLM's flag: a file, or the jinja "
            "template itself (a model whose tokenizer has none can chat with it)",
            default_help="the tokenizer's (a multimodal model's: its processor's)",
            metavar="FILE_OR_TEMPLATE",
        ),
    )
    # How message content reaches the template (vLLM's --chat-template-content-format; chat_content_format.py).
    chat_template_content_format: Literal["auto", "string", "openai"] = field(
        default="auto",
        metadata=flag(
            "how a message's content reaches the chat template, as vLLM's flag: 'string' (text, parts joined with "
            "newlines), 'openai' (a list of {'type': 'text'} parts), or 'auto' (the one the template loops over)"
        ),
    )
    # vLLM's --enable-auto-tool-choice: tool_choice "auto" (the default with tools) parsed by --tool-call-parser.
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata=flag(
            "serve chat's tool_choice 'auto' (the default when tools are sent), as vLLM's flag: the model decides, "
            "and --tool-call-parser parses its calls out of the reply; without it, 'auto' is refused"
        ),
    )
    # vLLM's --tool-call-parser: the format of the model's calls (tool_calls.py).
    tool_call_parser: Literal["hermes"] | None = field(
        default=None,
        metadata=flag(
            "the format of the model's tool calls, for --enable-auto-tool-choice, as vLLM's flag: 'hermes' "
            '(<tool_call>{"name": ..., "arguments": {...}}</tool_call>: Hermes 2 Pro, Qwen2.5, Qwen3)'
        ),
    )
    # vLLM's --reasoning-parser: chat replies split into their reasoning and content (reasoning.py).
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = field(
        default=None,
        metadata=flag(
            "split chat replies into 'reasoning' (<think>...</think>) and 'content', as vLLM's flag: 'deepseek_r1' "
            "(the block may be opened by the prompt; unclosed, all reasoning) or 'qwen3' (a reply that opens it)",
            default_help="off: the reply is all content",
        ),
    )
    # Where unset sampling fields take defaults from: "auto", "vllm" or a folder (generation_config.py).
    generation_config: str = field(
        default="auto",
        metadata=flag(
            "where sampling fields a request leaves unset take defaults from (as vLLM's flag): 'auto' (the "
            "model's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
            "max_new_tokens), 'vllm' (ignore it: vLLM's defaults), or a folder holding a generation_config.json"
        ),
    )
    # Whether clients may load and unload LoRA adapters (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=flag(
            "let clients load and unload LoRA adapters at run time (gRPC LoadLoraAdapter / UnloadLoraAdapter, "
            "HTTP /v1/load_lora_adapter and /v1/unload_lora_adapter), as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; "
            "a load makes the engine core read the path it is given (docs/operations.md)"
        ),
    )
    # Every call but health needs "authorization: Bearer <api_key>"; None: no key.
    api_key: str | None = field(
        default=None,
        metadata=flag(
            "require 'authorization: Bearer <key>' metadata on every call but health",
            default_help="$SPLITSERVE_API_KEY, which keeps the key out of the process list; unset: no key",
        ),
    )
    # TLS (and the client certificate) to the cores; None: plaintext. From the --core-ssl-* flags together.
    core_tls: ClientTLS | None = field(default=None, metadata=NOT_A_FLAG)
    # vLLM's --enable-prompt-tokens-details: the HTTP API's usage carries prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = field(
        default=False,
        metadata=flag(
            "the HTTP API's usage carries prompt_tokens_details.cached_tokens (prompt tokens served from the prefix "
            "cache), as vLLM's flag"
        ),
    )
    # vLLM's --return-tokens-as-token-ids: the HTTP API's logprobs show tokens as "token_id:<id>".
    return_tokens_as_token_ids: bool = field(
        default=False,
        metadata=flag(
            "the HTTP API's logprobs show each token as 'token_id:<id>' (a request's return_tokens_as_token_ids "
            "decides for itself), as vLLM's flag: tokens that are no whole character stay identifiable"
        ),
    )
    # vLLM's --stream-interval: streamed outputs every this many tokens (the first token at once, the last at the end).
    stream_interval: int = field(
        default=1,
        metadata=flag(
            "streamed outputs come for the first token, then every this many tokens at least, and at the end, as "
            "vLLM's flag (fewer, larger messages under load); a request's own stream_interval may raise it",
            unit="tokens",
        ),
    )
    # The most completions one call may ask for (docs/operations.md).
    max_n: int = field(
        default=MAX_N,
        metadata=flag(
            "the most completions (n) one call may ask for, from 1 to the default (vLLM's limit); a larger n is "
            "refused with INVALID_ARGUMENT (docs/operations.md)",
            unit="completions",
        ),
    )
    # The model's name to clients (vLLM's --served-model-name): GetModelInfo, metrics labels, spans; None: the model.
    served_model_name: str | None = field(
        default=None,
        metadata=flag(
            f"the name the model is reported by: {PUBLIC_MODEL_NAME}",
            default_help="the model as given",
            metavar="NAME",
        ),
    )

    # The most images one prompt may hold (vLLM's --limit-mm-per-prompt): "image=4" or '{"image": 4}'.
    limit_mm_per_prompt: str | None = field(
        default=None,
        metadata=flag(
            'the most images one prompt may hold, as vLLM\'s flag: image=N (or JSON {"image": N}); more are '
            "refused with INVALID_ARGUMENT (docs/operations.md)",
            default_help=f"image={DEFAULT_LIMIT_PER_PROMPT}, vLLM's",
            metavar="image=N",
        ),
    )

    # The OpenAI-compatible HTTP API's port (frontend_svc/openai_api.py); None: no HTTP API.
    http_port: int | None = field(
        default=None,
        metadata=flag(
            "also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
            "/tokenize, /detokenize, /health, /version) on this port, over the same engine",
            default_help="no HTTP API",
            metavar="PORT",
        ),
    )
    # Where the HTTP API listens; None: the gRPC server's --host.
    http_host: str | None = field(
        default=None,
        metadata=flag("the HTTP API's address", default_help="the same as --host", metavar="HOST"),
    )

    # vLLM's dev-mode routes on the HTTP API: POST /sleep, POST /wake_up, GET /is_sleeping (they change the cores
    # for every client, as the cores' admin RPCs, which they call, need --enable-admin-rpcs there).
    enable_admin_routes: bool = field(
        default=False,
        metadata=flag(
            "serve the HTTP API's admin routes, as vLLM serves them in its dev mode: POST /sleep?level=1|2, "
            "POST /wake_up[?tags=weights|kv_cache], GET /is_sleeping; every client of the HTTP API may call them "
            "(the cores must run with --enable-admin-rpcs; docs/operations.md)"
        ),
    )

    def __post_init__(self) -> None:
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)  # raises ValueError naming it
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
                f"{self.chat_template_content_format!r}"
            )
        if self.chat_template is not None:
            load_chat_template(self.chat_template)  # raises ValueError: a path that is not there
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (vLLM's rule): --tool-call-parser hermes")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            parsers = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"tool_call_parser must be one of {parsers}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            parsers = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {parsers}, got {self.reasoning_parser!r}")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}], got {self.max_n}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")


def load_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file ``value`` names, or ``value`` itself when it holds template syntax
    (a brace or a line break), as vLLM reads the flag.

    Raises:
        ValueError: ``value`` looks like a path (no template syntax) but no file is there, or cannot be read.
    """
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"chat_template: cannot read {value}: {e}") from e
    except ValueError:  # a template too long or odd to be a path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template: {value!r} looks like a file, but there is none (give a file or a template)")
