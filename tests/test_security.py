"""TLS, mTLS between frontend and core, the public API's key, and the core's admin RPCs.

Certificates are made at test time (``tests/tls_helpers.py``). The first tests run small gRPC servers in this
process; the last ones a core (mTLS, admin RPCs off) and a frontend (TLS, API key) as processes on loopback, the
frontend finding the core through a ``dns:///`` name as in Kubernetes, the core's certificate naming only that name.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from core_svc.admin import AdminPolicy
from core_svc.errors import InvalidRequestError
from splitserve.base import grpc_runtime
from splitserve.base.api_key import ApiKeyInterceptor, check_api_key
from splitserve.base.tls import ClientTLS, ServerTLS, read_pem, secure_or_insecure_aio_channel
from splitserve.entrypoints import stack
from splitserve.entrypoints.cli import main
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as core_grpc
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.tls_helpers import TestCA

API_KEY = "s3cret-key"
CORE_NAME = "splitserve-core"  # the only name on the core's certificate, as a cert-manager Certificate would have it


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """A CA with a server certificate for loopback, one for the core's name only, a client certificate; and another
    CA with a client certificate of its own."""
    root = tmp_path_factory.mktemp("pki")
    ca = TestCA.create(root / "ca", "splitserve test CA")
    other = TestCA.create(root / "other", "some other CA")
    return {
        "ca": ca,
        "other": other,
        "loopback": ca.issue("loopback", ("localhost",), ("127.0.0.1",)),
        "core": ca.issue("core", (CORE_NAME,)),
        "client": ca.issue("frontend-client"),
        "other_client": other.issue("other-client"),
    }


# --- TLS handshakes against an in-process server ------------------------------------------------------------


async def health_status(address: str, tls: ClientTLS | None, metadata: tuple = ()) -> str:
    """The server's liveness as a name, or the code the call failed with."""
    async with secure_or_insecure_aio_channel(address, tls) as channel:
        try:
            request = health_pb2.HealthCheckRequest()
            response = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def tls_outcomes(server_tls: ServerTLS, clients: dict[str, ClientTLS | None]) -> dict[str, str]:
    server = grpc_runtime.make_server()
    await grpc_runtime.add_health_and_reflection(server, [])
    port = grpc_runtime.add_port(server, grpc_runtime.ServerOptions("127.0.0.1", 0, tls=server_tls))
    await server.start()
    try:
        return {name: await health_status(f"127.0.0.1:{port}", tls) for name, tls in clients.items()}
    finally:
        await server.stop(0)


def test_a_tls_server_refuses_plaintext_and_unknown_cas(pki):
    ca, other, loopback = pki["ca"], pki["other"], pki["loopback"]
    outcomes = asyncio.run(
        tls_outcomes(
            ServerTLS(loopback.certfile, loopback.keyfile),
            {
                "tls": ClientTLS(ca.ca_certs),
                "plaintext": None,
                "wrong CA": ClientTLS(other.ca_certs),
                "wrong name": ClientTLS(ca.ca_certs, server_name="elsewhere.example"),
            },
        )
    )
    assert outcomes == {
        "tls": "SERVING",
        "plaintext": "UNAVAILABLE",
        "wrong CA": "UNAVAILABLE",
        "wrong name": "UNAVAILABLE",
    }


def test_an_mtls_server_requires_a_client_certificate_from_its_ca(pki):
    ca, core, client, other_client = pki["ca"], pki["core"], pki["client"], pki["other_client"]
    outcomes = asyncio.run(
        tls_outcomes(
            ServerTLS(core.certfile, core.keyfile, ca.ca_certs),
            {
                "client certificate": ClientTLS(ca.ca_certs, client.certfile, client.keyfile, CORE_NAME),
                "none": ClientTLS(ca.ca_certs, server_name=CORE_NAME),
                "another CA's": ClientTLS(ca.ca_certs, other_client.certfile, other_client.keyfile, CORE_NAME),
                "the host's name, not the certificate's": ClientTLS(ca.ca_certs, client.certfile, client.keyfile),
            },
        )
    )
    assert outcomes == {
        "client certificate": "SERVING",
        "none": "UNAVAILABLE",
        "another CA's": "UNAVAILABLE",
        "the host's name, not the certificate's": "UNAVAILABLE",
    }


def test_tls_flags_that_do_not_go_together_are_refused(pki, tmp_path):
    loopback = pki["loopback"]
    assert ServerTLS.from_flags(None, None, None) is None
    assert ServerTLS.from_flags("k", "c", None) == ServerTLS("c", "k", None)
    assert ServerTLS.from_flags("k", "c", "ca").requires_client_certificates
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile go together"):
        ServerTLS.from_flags("k", None, None)
    with pytest.raises(ValueError, match="--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile"):
        ServerTLS.from_flags(None, None, "ca")
    with pytest.raises(ValueError, match="both its certificate file and its key file"):
        ClientTLS(certfile=loopback.certfile)
    with pytest.raises(ValueError, match=f"--ssl-keyfile: cannot read {tmp_path / 'missing'}"):
        ServerTLS(loopback.certfile, str(tmp_path / "missing")).credentials()
    (tmp_path / "not.pem").write_text("hello")
    with pytest.raises(ValueError, match="is not a PEM file"):
        read_pem(str(tmp_path / "not.pem"), "--ssl-certfile")
    # The CLI reports them as errors (exit 2) before anything starts.
    assert main(["frontend", "--core", "localhost:1", "--ssl-keyfile", loopback.keyfile]) == 2
    assert main(["frontend", "--core", "localhost:1", "--core-ssl-certfile", loopback.certfile]) == 2


# --- the API key ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "authorized"),
    [
        ((("authorization", f"Bearer {API_KEY}"),), True),
        ((("authorization", f"bearer {API_KEY}"),), True),  # the scheme in any case (RFC 7235)
        ((("x-other", "1"), ("authorization", f"Bearer  {API_KEY} ")), True),
        ((("authorization", API_KEY),), False),  # no scheme
        ((("authorization", f"Basic {API_KEY}"),), False),
        ((("authorization", f"Bearer {API_KEY}x"),), False),
        ((("authorization", f"Bearer {API_KEY[:-1]}"),), False),
        ((("authorization", "Bearer "),), False),
        ((), False),
        (None, False),
    ],
)
def test_the_api_key_check(metadata, authorized):
    assert ApiKeyInterceptor(API_KEY).is_authorized(metadata) is authorized


def test_an_api_key_no_client_could_send_is_refused():
    """A key gRPC metadata cannot carry (not printable ASCII) made a server that refused every caller; surrounding
    whitespace (a Secret made from a file ends with a newline) is not part of the key, as clients cannot send it."""
    for key in ("", "  \n", "clé", "tab\tinside", "new\nline"):
        with pytest.raises(ValueError, match="must not be empty|must be printable ASCII"):
            ApiKeyInterceptor(key)
    assert check_api_key(f"{API_KEY}\n", "--api-key") == API_KEY
    assert check_api_key("with inner spaces", "--api-key") == "with inner spaces"
    interceptor = ApiKeyInterceptor(f" {API_KEY}\n")
    assert interceptor.is_authorized((("authorization", f"Bearer {API_KEY}"),))
    assert ApiKeyInterceptor("with inner spaces").is_authorized((("authorization", "Bearer with inner spaces"),))


def test_every_call_but_health_needs_the_api_key():
    """A server with the key: without it, a unary call, a server stream and reflection (a bidi stream) end with
    UNAUTHENTICATED before their handlers run; with it they reach the handlers (here the generated base class,
    which answers UNIMPLEMENTED); health answers either way."""

    async def scenario() -> dict[str, str]:
        server = grpc_runtime.make_server(interceptors=[ApiKeyInterceptor(API_KEY)])
        api_grpc.add_GenerationServicer_to_server(api_grpc.GenerationServicer(), server)
        await grpc_runtime.add_health_and_reflection(server, ["splitserve.frontend.v1.Generation"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        outcomes = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = api_grpc.GenerationStub(channel)
                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
                for label, metadata in (("no key", ()), ("key", (("authorization", f"Bearer {API_KEY}"),))):
                    calls = {
                        "GetModelInfo": lambda m=metadata: stub.GetModelInfo(api.GetModelInfoRequest(), metadata=m),
                        "Generate": lambda m=metadata: _drain(stub.Generate(api.GenerateRequest(), metadata=m)),
                        "reflection": lambda m=metadata: _drain(
                            reflection.ServerReflectionInfo(
                                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=m
                            )
                        ),
                    }
                    for name, call in calls.items():
                        try:
                            await call()
                            outcomes[f"{name}, {label}"] = "OK"
                        except grpc.aio.AioRpcError as e:
                            outcomes[f"{name}, {label}"] = e.code().name
                    outcomes[f"health, {label}"] = await health_status(f"127.0.0.1:{port}", None, metadata)
        finally:
            await server.stop(0)
        return outcomes

    assert asyncio.run(scenario()) == {
        "GetModelInfo, no key": "UNAUTHENTICATED",
        "Generate, no key": "UNAUTHENTICATED",
        "reflection, no key": "UNAUTHENTICATED",
        "health, no key": "SERVING",
        "GetModelInfo, key": "UNIMPLEMENTED",
        "Generate, key": "UNIMPLEMENTED",
        "reflection, key": "OK",
        "health, key": "SERVING",
    }


async def _drain(call: object) -> list:
    return [message async for message in call]  # type: ignore[attr-defined]  # a streaming call, iterable


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from splitserve.entrypoints.cli import api_key_from_args, build_parser

    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    assert api_key_from_args(build_parser().parse_args(["frontend", "--core", "c:1"])) is None
    monkeypatch.setenv("SPLITSERVE_API_KEY", "from-env")
    assert api_key_from_args(build_parser().parse_args(["frontend", "--core", "c:1"])) == "from-env"
    assert api_key_from_args(build_parser().parse_args(["serve", "--api-key", "flag"])) == "flag"
    monkeypatch.setenv("SPLITSERVE_API_KEY", "from-file\n")  # a Secret made --from-file
    assert api_key_from_args(build_parser().parse_args(["frontend", "--core", "c:1"])) == "from-file"
    # A key set to nothing is a mistake (a Secret that came out empty, --api-key "$UNSET"), not "no key": the
    # server would run open while its operator thinks it is not.
    monkeypatch.setenv("SPLITSERVE_API_KEY", "")
    with pytest.raises(ValueError, match="SPLITSERVE_API_KEY: the API key must not be empty"):
        api_key_from_args(build_parser().parse_args(["frontend", "--core", "c:1"]))
    monkeypatch.delenv("SPLITSERVE_API_KEY")
    with pytest.raises(ValueError, match="--api-key: the API key must not be empty"):
        api_key_from_args(build_parser().parse_args(["serve", "--api-key", ""]))
    assert main(["frontend", "--core", "localhost:1", "--api-key", " "]) == 2  # before anything starts
    assert main(["stack", "--api-key", ""]) == 2


# --- the core's admin RPCs: where profiles may go --------------------------------------------------------------


def test_profile_output_stays_inside_the_profile_dir(tmp_path):
    root = tmp_path / "profiles"
    admin = AdminPolicy.enabled_with(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)  # a link inside that points out
    resolved = root.resolve()
    assert admin.profile_output_dir("") == resolved
    assert admin.profile_output_dir("run-1") == resolved / "run-1"
    assert admin.profile_output_dir("a/b") == resolved / "a" / "b"
    assert admin.profile_output_dir(str(root / "run-2")) == resolved / "run-2"  # absolute, inside
    refused = {
        "../outside": "must not contain '..'",
        "a/../../outside": "must not contain '..'",
        str(outside): "is outside the core's profile directory",
        "/etc": "is outside the core's profile directory",
        "escape": "is outside the core's profile directory",
        "escape/deeper": "is outside the core's profile directory",
        "nul\x00": "NUL",
    }
    for output_dir, message in refused.items():
        with pytest.raises(InvalidRequestError, match=message):
            admin.profile_output_dir(output_dir)


def test_admin_rpcs_are_off_by_default_and_their_default_dir_is_private():
    assert AdminPolicy().enabled is False
    admin = AdminPolicy.enabled_with(None)
    try:
        assert admin.profile_dir is not None and admin.profile_dir.is_dir()
        assert admin.profile_dir.stat().st_mode & 0o777 == 0o700
    finally:
        admin.profile_dir.rmdir()
    with pytest.raises(ValueError, match="need a profile directory"):
        AdminPolicy(enabled=True)
    assert main(["core", "--profile-dir", "/tmp/x"]) == 2  # without --enable-admin-rpcs


# --- a TLS core and frontend as processes ------------------------------------------------------------------------


PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model
    from tests.conftest import real_or_builtin

    return str(
        make_test_model(tmp_path_factory.mktemp("tls-model"), "llama", "tiny", tokenizer=real_or_builtin("llama2"))
    )


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    from frontend_svc import LLM, SamplingParams

    with LLM(model) as llm:
        (output,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return list(output.outputs[0].token_ids)


@pytest.fixture(scope="module")
def tls_stack(model, pki, tmp_path_factory):
    """A core with mTLS (its certificate names only ``splitserve-core``) and a frontend with TLS and an API key
    that reaches it as ``dns:///splitserve-core:PORT`` (a hosts file says 127.0.0.1), presenting its client
    certificate."""
    ca, core_cert, loopback, client = pki["ca"], pki["core"], pki["loopback"], pki["client"]
    logs = tmp_path_factory.mktemp("tls-logs")
    hosts = logs / "hosts"
    hosts.write_text(f"127.0.0.1 {CORE_NAME}\n")
    core_port = stack.free_port()
    core_args = ["core", "--model", model, "--ssl-keyfile", core_cert.keyfile, "--ssl-certfile", core_cert.certfile]
    core_args += ["--ssl-ca-certs", ca.ca_certs]
    core_client = ClientTLS(ca.ca_certs, client.certfile, client.keyfile, CORE_NAME)
    core = stack.start_service("core", core_args, core_port, logs, stack.ENGINE_CORE_GRPC_SERVICE, tls=core_client)
    frontend = None
    try:
        core.wait_serving()
        frontend_args = ["frontend", "--model", model, "--core", f"dns:///{CORE_NAME}:{core_port}"]
        frontend_args += ["--ssl-keyfile", loopback.keyfile, "--ssl-certfile", loopback.certfile]
        frontend_args += ["--core-ssl-keyfile", client.keyfile, "--core-ssl-certfile", client.certfile]
        frontend_args += ["--core-ssl-ca-certs", ca.ca_certs]
        env = {"SPLITSERVE_HOSTS_FILE": str(hosts), "SPLITSERVE_API_KEY": API_KEY}
        frontend = stack.start_service(
            "frontend", frontend_args, stack.free_port(), logs, env=env, tls=ClientTLS(ca.ca_certs)
        )
        frontend.wait_serving()
        yield core, frontend
    finally:
        for process in (frontend, core):
            if process is not None:
                process.stop()


async def generate(address: str, tls: ClientTLS | None, api_key: str | None) -> list[int] | str:
    """The greedy completion's token ids, or the code the call failed with."""
    params = api.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with secure_or_insecure_aio_channel(address, tls) as channel:
        call = api_grpc.GenerationStub(channel).Generate(
            api.GenerateRequest(prompt=PROMPT, sampling_params=params), metadata=metadata, timeout=60
        )
        try:
            return [t async for response in call for t in response.outputs[0].token_ids]
        except grpc.aio.AioRpcError as e:
            return e.code().name


def test_generate_over_tls_with_the_api_key(tls_stack, pki, reference):
    _, frontend = tls_stack
    ca = pki["ca"]
    assert asyncio.run(generate(frontend.address, ClientTLS(ca.ca_certs), API_KEY)) == reference
    assert asyncio.run(generate(frontend.address, ClientTLS(ca.ca_certs), None)) == "UNAUTHENTICATED"
    assert asyncio.run(generate(frontend.address, ClientTLS(ca.ca_certs), "wrong")) == "UNAUTHENTICATED"
    assert asyncio.run(generate(frontend.address, None, API_KEY)) == "UNAVAILABLE"  # plaintext: refused
    assert asyncio.run(generate(frontend.address, ClientTLS(pki["other"].ca_certs), API_KEY)) == "UNAVAILABLE"


def test_the_core_takes_only_clients_with_a_certificate_from_its_ca(tls_stack, pki):
    from frontend_svc.errors import EngineDeadError
    from frontend_svc.grpc_client import GrpcCoreClient

    core, _ = tls_stack
    ca, client, other_client = pki["ca"], pki["client"], pki["other_client"]
    clients = {
        "plaintext": None,
        "no client certificate": ClientTLS(ca.ca_certs, server_name=CORE_NAME),
        "another CA's certificate": ClientTLS(ca.ca_certs, other_client.certfile, other_client.keyfile, CORE_NAME),
        "a client that trusts another CA": ClientTLS(pki["other"].ca_certs, client.certfile, client.keyfile, CORE_NAME),
        "the frontend's certificate": ClientTLS(ca.ca_certs, client.certfile, client.keyfile, CORE_NAME),
    }
    outcomes = {name: asyncio.run(health_status(core.address, tls)) for name, tls in clients.items()}
    assert outcomes == {name: "UNAVAILABLE" for name in clients} | {"the frontend's certificate": "SERVING"}
    # A frontend's client without a client certificate never gets a core.
    with pytest.raises(EngineDeadError, match="no engine core answered"):
        GrpcCoreClient([core.address], wait_ready_s=3, tls=clients["no client certificate"])


def test_admin_rpcs_are_refused_and_the_frontend_says_why(tls_stack, pki, tmp_path):
    from frontend_svc.errors import NotSupportedError
    from frontend_svc.grpc_client import GrpcCoreClient

    core, _ = tls_stack
    with core.channel() as channel:
        stub = core_grpc.EngineCoreStub(channel)
        for name, request in (
            ("ResetPrefixCache", core_pb.ResetPrefixCacheRequest()),
            ("StartProfile", core_pb.StartProfileRequest(output_dir=str(tmp_path))),
            ("StopProfile", core_pb.StopProfileRequest()),
            ("Sleep", core_pb.SleepRequest(level=1)),
            ("WakeUp", core_pb.WakeUpRequest()),
        ):
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, name)(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
            assert info.value.details() == (
                f"{name} is an admin RPC, off on this engine core; start it with --enable-admin-rpcs to allow it"
            )
        assert stub.GetLoad(core_pb.GetLoadRequest(), timeout=10).num_free_kv_blocks > 0  # frontends' calls work
        assert not stub.IsSleeping(core_pb.IsSleepingRequest(), timeout=10).is_sleeping  # changes nothing: not admin
    assert list(tmp_path.iterdir()) == []
    client = GrpcCoreClient([core.address], wait_ready_s=30, tls=core.tls)
    try:
        with pytest.raises(NotSupportedError, match="ResetPrefixCache is an admin RPC, off"):
            client.reset_prefix_cache()
        with pytest.raises(NotSupportedError, match="Sleep is an admin RPC, off"):
            client.sleep(1)
    finally:
        client.shutdown()


def test_splitserve_health_speaks_tls(tls_stack, pki, capsys):
    core, frontend = tls_stack
    ca, client = pki["ca"], pki["client"]
    service = ["--service", stack.ENGINE_CORE_GRPC_SERVICE]
    mtls = ["--ssl-ca-certs", ca.ca_certs, "--ssl-certfile", client.certfile, "--ssl-keyfile", client.keyfile]
    assert main(["health", "--address", core.address, *service, *mtls, "--ssl-server-name", CORE_NAME]) == 0
    assert f"{core.address} {stack.ENGINE_CORE_GRPC_SERVICE}: SERVING" in capsys.readouterr().out
    assert main(["health", "--address", core.address, *service, *mtls]) == 1  # its certificate names splitserve-core
    assert main(["health", "--address", core.address, *service, "--timeout", "1"]) == 1  # plaintext
    assert main(["health", "--address", frontend.address, "--ssl-ca-certs", ca.ca_certs]) == 0
    assert main(["health", "--address", frontend.address, "--timeout", "1"]) == 1


def test_the_stack_launcher_runs_a_tls_stack(model, pki, tmp_path, reference):
    """``stack.StackTLS`` (``splitserve stack --ssl-*``): one certificate for both servers and the frontend's
    client certificate; the launcher's health checks and channels speak TLS."""
    ca, loopback = pki["ca"], pki["loopback"]
    tls = stack.StackTLS.from_flags(loopback.keyfile, loopback.certfile, ca.ca_certs)
    with pytest.raises(ValueError, match="needs --ssl-keyfile, --ssl-certfile and --ssl-ca-certs"):
        stack.StackTLS.from_flags(loopback.keyfile, loopback.certfile, None)
    core = stack.start_core(model, tmp_path, tls=tls)
    frontend = None
    try:
        core.wait_serving()
        frontend = stack.start_frontend(model, [core.address], tmp_path, tls=tls)
        frontend.wait_serving()
        assert asyncio.run(generate(frontend.address, tls.client(), None)) == reference
        assert asyncio.run(health_status(core.address, ClientTLS(ca.ca_certs))) == "UNAVAILABLE"  # mTLS
    finally:
        for process in (frontend, core):
            if process is not None:
                assert process.stop() == 0


def test_no_private_key_is_committed():
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = [root / p for p in listed.stdout.decode().split("\0") if p]
    pem_key = re.compile(rb"^-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----\r?$", re.MULTILINE)  # a PEM block's first line
    keys = [p for p in tracked if p.is_file() and pem_key.search(p.read_bytes())]
    assert keys == []
