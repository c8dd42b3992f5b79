"""``LLM(model, core_address=...)``: waiting for a core says so at once and while it lasts, giving up says what
was waited for and how long; engine settings, which a remote core takes as its own flags, are refused; a model
folder that is not there is named."""

from __future__ import annotations

import logging

import pytest

import frontend_svc.grpc_client
from frontend_svc import LLM, EngineDeadError
from splitserve.base.model_files import ModelNotFoundError
from splitserve.entrypoints.stack import free_port


def test_engine_settings_with_core_address_are_refused_naming_them(checkpoint):
    with pytest.raises(ValueError) as refused:
        LLM(str(checkpoint("llama")), core_address="127.0.0.1:1", max_num_seqs=4, dtype="float32")
    assert str(refused.value) == (
        "engine-core settings apply to an in-process core; with core_address they are the core's own flags: "
        "max_num_seqs, dtype"
    )
    # An empty address is an address given: its settings are refused too, and it names no core.
    with pytest.raises(ValueError, match="with core_address they are the core's own flags: max_num_seqs"):
        LLM(str(checkpoint("llama")), core_address="", max_num_seqs=4)
    with pytest.raises(ValueError, match="core_address names no core: ' , '"):
        LLM(str(checkpoint("llama")), core_address=" , ")


def test_a_missing_model_folder_is_named(tmp_path):
    for core_address in (None, "127.0.0.1:1"):
        with pytest.raises(ModelNotFoundError) as missing:
            LLM("/nonexistent/path", core_address=core_address)
        assert str(missing.value) == "no such folder: /nonexistent/path"
        with pytest.raises(ModelNotFoundError) as empty:
            LLM(str(tmp_path), core_address=core_address)
        assert str(empty.value) == f"{tmp_path} is not a model folder: no config.json"


def test_waiting_for_a_core_that_is_not_there_says_so(checkpoint, monkeypatch, caplog):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("SPLITSERVE_ENGINE_READY_TIMEOUT_S", "2")
    monkeypatch.setattr(frontend_svc.grpc_client, "WAIT_LOG_INTERVAL_S", 0.25)
    with caplog.at_level(logging.INFO, logger="frontend_svc.grpc_client"), pytest.raises(EngineDeadError) as gave_up:
        LLM(str(checkpoint("llama")), core_address=address)
    message = str(gave_up.value)
    assert message.startswith(
        f"no engine core answered at {address} within 2 s (waited for a Connect stream to it and its health to say "
        f"SERVING; is `splitserve core` running there?); latest attempt: {address}: UNAVAILABLE "
    )
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if "waiting for the engine core" in r.getMessage()]
    assert logged[0] == (logging.INFO, f"waiting for the engine core at {address} (up to 2 s) ...")
    still = [text for level, text in logged[1:] if level == logging.WARNING]
    assert still and all(text.startswith(f"still waiting for the engine core at {address}: ") for text in still)


def test_the_ready_timeout_must_be_a_positive_number(checkpoint, monkeypatch):
    for value in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("SPLITSERVE_ENGINE_READY_TIMEOUT_S", value)
        with pytest.raises(ValueError) as refused:
            LLM(str(checkpoint("llama")), core_address="127.0.0.1:1")
        assert str(refused.value) == (
            f"SPLITSERVE_ENGINE_READY_TIMEOUT_S must be a number of seconds above 0, got {value!r}"
        )
