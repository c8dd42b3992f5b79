"""make-test-model: presets, the builtin tokenizer, real tokenizers, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from splitserve.entrypoints.builtin_tokenizer import train_tokenizer
from splitserve.entrypoints.test_model import TEXT_ARCHS, build_config
from tests.conftest import shared_tokenizer


def count_parameters(arch: str, preset: str, vocab_size: int) -> int:
    import transformers

    config = build_config(arch, preset, vocab_size, 1, 2)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_preset_sizes(arch):
    # qwen3 checkpoints tie the LM head to the embedding: one vocab x hidden matrix fewer.
    small_min = 35e6 if arch == "qwen3" else 50e6
    assert 0.5e6 <= count_parameters(arch, "tiny", 8192) <= 1.5e6
    assert small_min <= count_parameters(arch, "small", 32000) <= 70e6
    assert 150e6 <= count_parameters(arch, "medium", 32000) <= 250e6


def test_builtin_tokenizer_is_deterministic_and_round_trips():
    a, b = train_tokenizer(), train_tokenizer()
    assert a.to_str() == b.to_str()
    text = "Grüße, 東京! 😀 def f(x): return x ** 2"
    encoded = a.encode(text)
    assert encoded.ids[0] == a.token_to_id("<s>")
    assert a.decode(encoded.ids) == text


def test_checkpoint_is_seeded_and_loadable_by_transformers(checkpoint, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitserve.entrypoints.test_model import make_test_model

    path = checkpoint("qwen2")
    again = make_test_model(tmp_path / "again", arch="qwen2", preset="tiny", seed=0)
    other = make_test_model(tmp_path / "other", arch="qwen2", preset="tiny", seed=1)
    first, second, third = (load_file(p / "model.safetensors") for p in (path, again, other))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], third["model.embed_tokens.weight"])
    # Biases and norms are not left at transformers' trivial 0 and 1.
    assert first["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    assert not torch.equal(first["model.norm.weight"], torch.ones_like(first["model.norm.weight"]))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer)
    generation_config = json.loads((path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == tokenizer.eos_token_id
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        == "<s>[INST] hi [/INST] "
    )


@pytest.mark.parametrize("name", ["llama2", "gpt2"])
def test_real_tokenizer_sets_the_vocabulary(checkpoint, name):
    from transformers import AutoTokenizer

    folder = shared_tokenizer(name)
    path = checkpoint("llama", tokenizer=folder)
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert config["vocab_size"] == len(tokenizer) == {"llama2": 32000, "gpt2": 50257}[name]
    assert config["eos_token_id"] == tokenizer.eos_token_id


def test_make_test_model_command(tmp_path):
    out = tmp_path / "cli-model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.entrypoints.cli",
            "make-test-model",
            str(out),
            "--arch",
            "mistral",
            "--preset",
            "tiny",
            "--seed",
            "3",
            "--dtype",
            "bfloat16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote mistral/tiny checkpoint" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["dtype"] == "bfloat16"
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name


def test_unknown_arch_is_rejected(tmp_path):
    from splitserve.entrypoints.test_model import make_test_model

    with pytest.raises(ValueError, match="unknown arch 'gpt2'; choose from llama, mistral, qwen2, qwen3"):
        make_test_model(tmp_path, arch="gpt2")
