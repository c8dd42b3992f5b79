"""The example clients of ``examples/``, run as the README's lines run them, against a split stack on loopback: one
core, a plaintext frontend and a frontend with TLS and an API key. Each prints what the in-process ``LLM`` (or the
public API through the Python stubs) returns for the same greedy request."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.base.api_key import UNAUTHENTICATED_MESSAGE
from splitserve.base.tls import ClientTLS
from splitserve.entrypoints import stack
from tests.test_grpc_split import generate, greedy, joined
from tests.tls_helpers import TestCA

ROOT = Path(__file__).resolve().parents[1]
PYTHON_CLIENT = ROOT / "examples" / "python" / "generate.py"
NODE_EXAMPLE = ROOT / "examples" / "node"
PROMPT = "The capital of France is"
CHAT = "Write a haiku about autumn."
MAX_TOKENS = 12
API_KEY = "example-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from splitserve.entrypoints.test_model import make_test_model

    return str(make_test_model(tmp_path_factory.mktemp("clients-model"), "llama", "tiny"))


@pytest.fixture(scope="module")
def reference(model) -> dict[str, tuple[str, str, int, int]]:
    """What the in-process LLM returns for the greedy completion and chat: (text, finish reason, prompt tokens,
    completion tokens) by call."""
    from frontend_svc import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model) as llm:
        (completion,) = llm.generate([PROMPT], params, use_tqdm=False)
        (chat,) = llm.chat([{"role": "user", "content": CHAT}], params, use_tqdm=False)
    return {
        name: (o.outputs[0].text, o.outputs[0].finish_reason, len(o.prompt_token_ids), len(o.outputs[0].token_ids))
        for name, o in (("generate", completion), ("chat", chat))
    }


@pytest.fixture(scope="module")
def frontends(model, tmp_path_factory) -> Iterator[dict[str, stack.ServiceProcess | str]]:
    """One core; over it a plaintext frontend ("plain") and one serving TLS that requires API_KEY ("tls"), whose
    CA's certificate is "ca"."""
    root = tmp_path_factory.mktemp("clients")
    ca = TestCA.create(root / "ca")
    server = ca.issue("loopback", ("localhost",), ("127.0.0.1",))
    core = stack.start_core(model, root / "logs")
    processes = [core]
    try:
        core.wait_serving()
        processes.append(stack.start_frontend(model, [core.address], root / "logs"))
        tls_args = ["frontend", "--model", model, "--core", core.address, "--api-key", API_KEY]
        tls_args += ["--ssl-keyfile", server.keyfile, "--ssl-certfile", server.certfile]
        processes.append(
            stack.start_service("frontend-tls", tls_args, stack.free_port(), root / "logs", tls=ClientTLS(ca.ca_certs))
        )
        for process in processes[1:]:
            process.wait_serving()
        yield {"plain": processes[1], "tls": processes[2], "ca": ca.ca_certs}
    finally:
        for process in reversed(processes):
            process.stop()


def run_python_client(*args: str) -> subprocess.CompletedProcess[str]:
    """``.venv/bin/python examples/python/generate.py ARGS`` from the checkout, as the README runs it."""
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_API_KEY"}
    return subprocess.run(
        [sys.executable, str(PYTHON_CLIENT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )


def summary(finish_reason: str, prompt_tokens: int, completion_tokens: int) -> str:
    return f"[finish_reason {finish_reason}, {prompt_tokens} prompt tokens, {completion_tokens} completion tokens]\n"


@pytest.mark.parametrize("call", ["generate", "chat"])
def test_python_client_prints_what_the_llm_returns(frontends, reference, call):
    text, finish_reason, prompt_tokens, completion_tokens = reference[call]
    assert finish_reason == "length" and completion_tokens == MAX_TOKENS and text  # a case worth comparing
    prompt = ["--chat", CHAT] if call == "chat" else [PROMPT]
    address = frontends["plain"].address
    result = run_python_client("--address", address, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", *prompt)
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    assert result.stderr.endswith(summary(finish_reason, prompt_tokens, completion_tokens))


def test_python_client_over_tls_with_an_api_key(frontends, reference):
    text, finish_reason, prompt_tokens, completion_tokens = reference["generate"]
    args = ["--address", frontends["tls"].address, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    args += ["--ssl-ca-certs", frontends["ca"]]
    result = run_python_client(*args, "--api-key", API_KEY, PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"
    assert result.stderr.endswith(summary(finish_reason, prompt_tokens, completion_tokens))
    refused = run_python_client(*args, "--api-key", "wrong", PROMPT)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == f"error: UNAUTHENTICATED: {UNAUTHENTICATED_MESSAGE}\n"


def _node_modules() -> Path:
    """examples/node's dependencies, installed by ``npm install`` from its package.json and .npmrc (what the README's
    line runs) into an ignored folder of the checkout; again whenever package.json changes."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("Node.js and npm are not installed")
    folder = ROOT / ".cache" / "node-client"
    package_json = (NODE_EXAMPLE / "package.json").read_text()
    installed = folder / "installed-package.json"  # written once npm install has succeeded
    if not (installed.is_file() and installed.read_text() == package_json):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name in ("package.json", ".npmrc"):
            shutil.copy(NODE_EXAMPLE / name, folder / name)
        result = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund"], cwd=folder, capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            pytest.skip(f"npm could not install the gRPC packages: {result.stderr[-300:]}")
        installed.write_text(package_json)
    return folder / "node_modules"


def test_node_client_streams_generate_from_the_proto_files(frontends):
    node_modules = _node_modules()
    address = frontends["plain"].address
    result = subprocess.run(
        ["node", str(NODE_EXAMPLE / "generate.js"), address, PROMPT, str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"NODE_PATH": str(node_modules), "PATH": "/usr/bin:/bin:/usr/local/bin"},
    )
    assert result.returncode == 0, result.stderr
    messages = [json.loads(line) for line in result.stdout.splitlines()]
    node_text = "".join(m["text"] for m in messages)
    node_ids = [t for m in messages for t in m["tokenIds"]]
    python = asyncio.run(generate(address, PROMPT, greedy(max_tokens=MAX_TOKENS)))
    assert (node_text, node_ids) == joined(python) and len(node_ids) == MAX_TOKENS
    assert messages[-1]["finished"] is True
