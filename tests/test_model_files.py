"""Finding a model: a name meant as a path that names no folder says so, a hub id the hub cannot give says why,
each in one line."""

from __future__ import annotations

import pytest

from splitserve.base.model_files import ModelNotFoundError, check_model, looks_like_path, resolve_model_path

HUB_ID = "Qwen/Qwen2.5-0.5B"
OFFLINE_MESSAGE = (
    f"could not download {HUB_ID!r} from the Hugging Face hub: this machine could not reach the hub (offline, or "
    "HF_HUB_OFFLINE is set) and the model is not in its cache; pass a local model folder instead"
)


@pytest.mark.parametrize(
    ("model", "is_path"),
    [
        ("/nonexistent/path", True),
        ("./model", True),
        ("../model", True),
        ("~/model", True),
        (".", True),
        ("models/llama/7b", True),  # more separators than org/name
        ("my model", True),  # no hub id has a space
        ("org/", True),
        (HUB_ID, False),
        ("gpt2", False),
        ("org/name", False),
    ],
)
def test_looks_like_path(model, is_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty folder: no first part of these exists here
    assert looks_like_path(model) is is_path


def test_a_name_whose_first_part_exists_here_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_like_path("models/llama") is True
    assert looks_like_path("other/llama") is False
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_model_path("models/llama")
    assert str(missing.value) == "no such folder: models/llama"


def test_local_folders_are_checked_before_the_hub_is_asked(tmp_path, monkeypatch):
    def no_hub(*args: object, **kwargs: object) -> str:
        raise AssertionError("the hub was asked")

    monkeypatch.setattr("huggingface_hub.snapshot_download", no_hub)
    cases = {
        "/nonexistent/path": "no such folder: /nonexistent/path",
        str(tmp_path / "missing"): f"no such folder: {tmp_path / 'missing'}",
        "~/surely-no-such-splitserve-model": "no such folder: ~/surely-no-such-splitserve-model",
    }
    (tmp_path / "empty").mkdir()
    cases[str(tmp_path / "empty")] = f"{tmp_path / 'empty'} is not a model folder: no config.json"
    (tmp_path / "weights.safetensors").write_bytes(b"")
    cases[str(tmp_path / "weights.safetensors")] = (
        f"{tmp_path / 'weights.safetensors'} is a file, not a model folder (a Hugging Face checkpoint folder)"
    )
    for model, message in cases.items():
        for lookup in (resolve_model_path, check_model):
            with pytest.raises(ModelNotFoundError) as error:
                lookup(model)
            assert str(error.value) == message, (lookup, model)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model_path(str(model)) == model
    check_model(str(model))


def test_a_hub_id_the_hub_cannot_give_is_one_line_naming_it(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # Offline, with an empty cache: what a machine without network sees, without depending on having none.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    for lookup in (resolve_model_path, check_model):
        with pytest.raises(ModelNotFoundError) as error:
            lookup(HUB_ID)
        assert str(error.value) == OFFLINE_MESSAGE
