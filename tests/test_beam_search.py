"""Beam search (``LLM.beam_search``, vLLM's): against transformers' beam search, and against the same rules run on
transformers' logits where a beam ends at EOS or at max_model_len."""

from __future__ import annotations

import pytest
import torch

from frontend_svc import LLM, BeamSearchParams, ValidationError
from tests.conftest import real_or_builtin
from tests.helpers import hf_beam_search, hf_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model

    return make_test_model(
        tmp_path_factory.mktemp("beam-tiny"), "llama", "tiny", tokenizer=real_or_builtin("llama2"), seed=0
    )


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, plain_model):
    """The tiny checkpoint with EOS's LM-head row made 0.98 of the row of the token it ranks first after the first
    prompt, so that EOS is among the best candidates there and beams end early."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("beam-eos") / "model"
    shutil.copytree(plain_model, path)
    tensors = load_file(path / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = hf_model(plain_model)(torch.tensor([tokenizer(PROMPTS[0]).input_ids])).logits[0, -1]
    head = tensors["lm_head.weight"]
    head[tokenizer.eos_token_id] = 0.98 * head[int(logits.argmax())]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def reference_beam_search(
    path, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float, ignore_eos: bool = False
) -> list[tuple[list[int], float, str]]:
    """vLLM's rules on transformers' logits (a full forward per beam, no cache): each beam extended by its
    2 x width most likely tokens, EOS ending a beam, the width best kept by cumulative logprob over
    (length, prompt included, a final EOS not counted) ** length_penalty. (tokens, cumulative logprob,
    finish reason) of the best ``width``, best first."""
    model = hf_model(path)

    def score(beam: tuple[list[int], float, str]) -> float:
        tokens, cumulative, _ = beam
        length = len(tokens) - (tokens[-1] == eos)
        return cumulative / length**length_penalty

    beams: list[tuple[list[int], float, str]] = [(prompt, 0.0, "")]
    ended: list[tuple[list[int], float, str]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cumulative, _ in beams:
            with torch.no_grad():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            values, ids = logprobs.topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                child = ([*tokens, token], cumulative + value, "")
                if token == eos and not ignore_eos:
                    ended.append((child[0], child[1], "stop"))
                else:
                    candidates.append(child)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    ended += [(tokens, cumulative, "length") for tokens, cumulative, _ in beams]
    return sorted(ended, key=score, reverse=True)[:width]


def test_beam_search_matches_transformers_beam_search(plain_model):
    """Where no candidate is EOS, every beam runs to max_tokens and the ranking is transformers' too: the same
    sequences in the same order as its ``generate(num_beams=...)``; each one's cumulative logprob is the sum of
    transformers' logprobs along it, and its text the tokenizer's decode of all its tokens."""
    width, max_tokens = 4, 8
    with LLM(str(plain_model), num_kv_blocks=257) as llm:
        outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
        tokenizer = llm.get_tokenizer()
    model = hf_model(plain_model)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        expected = hf_beam_search(plain_model, prompt_ids, width, max_tokens)
        assert [beam.tokens for beam in output.sequences] == expected
        for beam in output.sequences:
            with torch.no_grad():
                logprobs = model(torch.tensor([beam.tokens])).logits[0].float().log_softmax(-1)
            expected = sum(logprobs[i - 1, beam.tokens[i]].item() for i in range(len(prompt_ids), len(beam.tokens)))
            assert beam.cum_logprob == pytest.approx(expected, abs=1e-4)
            assert beam.text == tokenizer.decode(beam.tokens)
            assert beam.finish_reason == "length"
            assert len(beam.logprobs) == max_tokens and all(len(step) == 2 * width for step in beam.logprobs)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beams_end_at_eos_and_rank_by_length_penalty(eos_model, length_penalty, ignore_eos):
    width, max_tokens = 3, 6
    with LLM(str(eos_model), num_kv_blocks=257) as llm:
        tokenizer = llm.get_tokenizer()
        params = BeamSearchParams(
            beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos
        )
        outputs = llm.beam_search(PROMPTS[:2], params)
    eos = tokenizer.eos_token_id
    stopped = 0
    for prompt, output in zip(PROMPTS[:2], outputs, strict=True):
        expected = reference_beam_search(
            eos_model, tokenizer(prompt).input_ids, width, max_tokens, eos, length_penalty, ignore_eos
        )
        assert [(b.tokens, b.finish_reason) for b in output.sequences] == [(t, f) for t, _, f in expected]
        assert [b.cum_logprob for b in output.sequences] == pytest.approx([c for _, c, _ in expected], abs=1e-4)
        stopped += sum(b.finish_reason == "stop" for b in output.sequences)
    # the checkpoint makes EOS a top candidate: some returned beam ended there unless EOS is ignored
    assert (stopped > 0) == (not ignore_eos)


def test_beams_end_at_max_model_len_and_prompts_are_searched_in_groups(plain_model):
    """A beam with no room left ends by length; searching two prompts at a time gives the same beams."""
    width = 2
    with LLM(str(plain_model), num_kv_blocks=257, max_model_len=16) as llm:
        tokenizer = llm.get_tokenizer()
        params = BeamSearchParams(beam_width=width, max_tokens=50)
        outputs = llm.beam_search(PROMPTS, params)
        grouped = llm.beam_search(PROMPTS, params, concurrency_limit=2)
    assert [[b.tokens for b in o.sequences] for o in grouped] == [[b.tokens for b in o.sequences] for o in outputs]
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        expected = reference_beam_search(plain_model, prompt_ids, width, 16 - len(prompt_ids), -1, 1.0)
        assert [b.tokens for b in output.sequences] == [tokens for tokens, _, _ in expected]
        assert all(len(b.tokens) == 16 and b.finish_reason == "length" for b in output.sequences)


def test_bad_beam_search_arguments_are_refused(plain_model):
    with pytest.raises(ValidationError, match="beam_width: must be at least 1, got 0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValidationError, match="max_tokens: must be at least 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValidationError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1.0)
    with LLM(str(plain_model), num_kv_blocks=64) as llm:
        with pytest.raises(ValidationError, match=r"beam_width: needs 2 x beam_width = 22 logprobs .* at most 10"):
            llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
        with pytest.raises(ValidationError, match="concurrency_limit: must be at least 1"):
            llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
        with pytest.raises(ValidationError, match="lora_request: has 1 entries for 3 prompts"):
            llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), lora_request=[None])
        with pytest.raises(ValidationError, match="prompt: has .* maximum context length"):
            llm.beam_search([[5] * 5000], BeamSearchParams(beam_width=2, max_tokens=2))  # as generate refuses it
        # nothing was left running: a search after the refusals works
        (output,) = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))
        assert len(output.sequences) == 2
