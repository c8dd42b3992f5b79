"""Qwen2-VL / Qwen2.5-VL end to end in the engine core: greedy ids equal transformers' ``generate`` (float32, the
same random checkpoint, images through its own image processor), with M-RoPE positions made by the model runner
for every kind of chunk: prefill, a chunk cut inside an image, a prefix-cache hit, a recompute after preemption,
decodes, and decodes replayed through the decode graphs.

The tiny random model's greedy ids depend little on the image, so each sampled token's logprob is compared too
(to 1e-4): wrong M-RoPE positions move them more than five times that (``test_text_positions_are_caught``)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from core_svc.cuda_graphs import EagerCapturer
from core_svc.engine_core import EngineCore
from core_svc.errors import InvalidRequestError
from core_svc.request import MultiModalFeature, MultiModalTensor, Request
from core_svc.sampling_params import SamplingParams
from tests.helpers import features_from_the_wire, make_engine
from tests.test_qwen2_vl import _build, build_prompt, hf_inputs

MAX_TOKENS = 6
ATOL = 1e-4
Result = tuple[list[int], list[float]]  # greedy ids, each one's logprob


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _build("qwen2_vl", tmp_path_factory)


def _hf_greedy(vl: tuple, ids: list[int], features: list[MultiModalFeature]) -> Result:
    hf = vl[1]
    inputs = hf_inputs(vl, ids, features)
    with torch.no_grad():
        out = hf.generate(
            **inputs,
            attention_mask=torch.ones_like(inputs["input_ids"]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [float(step[0].log_softmax(-1)[t]) for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def _assert_matches(ours: Result, expected: Result) -> None:
    assert ours[0] == expected[0]
    torch.testing.assert_close(torch.tensor(ours[1]), torch.tensor(expected[1]), atol=ATOL, rtol=0)


def _engine(vl: tuple, **overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"attention_backend": "torch_ref", "num_kv_blocks": 64, "block_size": 4}
    return make_engine(vl[0], **(settings | overrides))


def _run(
    engine: EngineCore, requests: list[tuple[list[int], list[MultiModalFeature]]]
) -> tuple[list[tuple[Result, int]], int]:
    """(greedy ids, their logprobs) and num_cached_tokens of each (prompt, features), all added at once; and the
    preemptions seen."""
    results: dict[str, tuple[Result, int]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for i, (ids, features) in enumerate(requests):
        request_id = f"r{i}-{id(results)}"
        engine.add_request(Request(request_id, ids, params, mm_features=features))
        results[request_id] = (([], []), 0)
    num_preemptions = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_preemptions += outputs.scheduler_stats.num_preemptions if outputs.scheduler_stats else 0
        for output in outputs.outputs:
            (tokens, logprobs), _ = results[output.request_id]
            new_logprobs = [row[0] for row in output.new_logprobs.logprobs] if output.new_logprobs else []
            results[output.request_id] = (
                (tokens + output.new_token_ids, logprobs + new_logprobs),
                output.num_cached_tokens,
            )
    return list(results.values()), num_preemptions


def test_one_image_matches_transformers(vl: tuple) -> None:
    ids, features = build_prompt(vl, [0])
    engine = _engine(vl)
    [(ours, _)], _ = _run(engine, [(ids, features)])
    _assert_matches(ours, _hf_greedy(vl, ids, features))
    assert engine.model_runner.num_encoder_calls == 1


def test_text_positions_are_caught(qwen2_vl: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards the other tests: 1-D positions (all three streams equal, delta 0) in place of M-RoPE's move the
    # logprobs more than five times the tolerance, and another image moves them more still.
    ids, features = build_prompt(qwen2_vl, [0])
    expected = _hf_greedy(qwen2_vl, ids, features)
    other_image = _hf_greedy(qwen2_vl, *build_prompt(qwen2_vl, [1]))
    assert max(abs(a - b) for a, b in zip(expected[1], other_image[1], strict=True)) > 100 * ATOL
    engine = _engine(qwen2_vl)
    model = engine.model_runner.model
    monkeypatch.setattr(model, "get_mrope_input_positions", lambda n, _: (torch.arange(n).expand(3, -1), 0))
    [((_, logprobs), _)], _ = _run(engine, [(ids, features)])
    assert max(abs(a - b) for a, b in zip(logprobs, expected[1], strict=True)) > 5 * ATOL


def test_two_images_of_different_sizes_in_one_prompt(qwen2_vl: tuple) -> None:
    ids, features = build_prompt(qwen2_vl, [1, 0])
    assert [f.length for f in features] == [8, 6]  # portrait 4 x 2 merged tokens, landscape 2 x 3
    [(ours, _)], _ = _run(_engine(qwen2_vl), [(ids, features)])
    _assert_matches(ours, _hf_greedy(qwen2_vl, ids, features))


def test_one_client_identifier_for_images_of_different_sizes(qwen2_vl: tuple) -> None:
    # A client reuses one identifier for items of different lengths, in one prompt and across two requests: the
    # core hashes each item itself, so no step fails on a cached item of another length, and none is shared.
    two, one = build_prompt(qwen2_vl, [1, 0]), build_prompt(qwen2_vl, [2])
    engine = _engine(qwen2_vl)
    results, _ = _run(engine, [(ids, features_from_the_wire(features, "same")) for ids, features in (two, one)])
    for (ours, _), (ids, features) in zip(results, (two, one), strict=True):
        _assert_matches(ours, _hf_greedy(qwen2_vl, ids, features))
    assert engine.model_runner.num_encoder_calls == 3


def test_chunked_prefill_inside_an_image(qwen2_vl: tuple) -> None:
    # Chunks of 5 tokens start and end inside both images' placeholder runs (and their M-RoPE grids).
    ids, features = build_prompt(qwen2_vl, [1, 0])
    engine = _engine(qwen2_vl, max_num_batched_tokens=5, long_prefill_token_threshold=0)
    assert any(f.offset % 5 and (f.offset + f.length) % 5 for f in features)
    [(ours, _)], _ = _run(engine, [(ids, features)])
    _assert_matches(ours, _hf_greedy(qwen2_vl, ids, features))
    assert engine.model_runner.num_encoder_calls == 2


def test_prefix_cache_hit_on_a_repeated_image(qwen2_vl: tuple) -> None:
    ids, features = build_prompt(qwen2_vl, [0, 1])
    engine = _engine(qwen2_vl, enable_prefix_caching=True)
    [(first, cached_first)], _ = _run(engine, [(ids, features)])
    [(again, cached_again)], _ = _run(engine, [(ids, features)])
    assert cached_first == 0
    assert cached_again >= features[-1].offset + features[-1].length  # past both images: positions from there on
    expected = _hf_greedy(qwen2_vl, ids, features)
    _assert_matches(first, expected)
    _assert_matches(again, expected)


def test_preemption_recomputes_with_the_same_positions(qwen2_vl: tuple) -> None:
    # A KV cache too small for three requests at full length: some are preempted and recomputed over prompt and
    # outputs (positions past the prompt at index + delta), with the same ids as transformers.
    prompts = [build_prompt(qwen2_vl, images) for images in ([0], [1], [2, 0])]
    engine = _engine(qwen2_vl, num_kv_blocks=12, enable_prefix_caching=False)
    results, num_preemptions = _run(engine, prompts)
    assert num_preemptions > 0
    for (ids, features), (ours, _) in zip(prompts, results, strict=True):
        _assert_matches(ours, _hf_greedy(qwen2_vl, ids, features))


def test_mixed_batch_with_a_text_only_request(qwen2_vl: tuple) -> None:
    ids, features = build_prompt(qwen2_vl, [2])
    text_ids, no_features = build_prompt(qwen2_vl, [])
    engine = _engine(qwen2_vl)
    results, _ = _run(engine, [(text_ids, no_features), (ids, features), (text_ids[:-2], [])])
    _assert_matches(results[0][0], _hf_greedy(qwen2_vl, text_ids, []))
    _assert_matches(results[1][0], _hf_greedy(qwen2_vl, ids, features))
    _assert_matches(results[2][0], _hf_greedy(qwen2_vl, text_ids[:-2], []))


def test_decode_graphs_take_mrope_positions(qwen2_vl: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode steps replay the captured graphs (EagerCapturer on CPU) on the [3, size] M-RoPE buffer columns.
    prompts = [build_prompt(qwen2_vl, images) for images in ([0], [1, 2])]
    engine = _engine(qwen2_vl)
    runner = engine.model_runner
    runner.capture_decode_graphs(EagerCapturer())
    replays: list[int] = []
    assert runner.decode_graphs is not None
    replay = runner.decode_graphs.replay
    monkeypatch.setattr(runner.decode_graphs, "replay", lambda size: replays.append(size) or replay(size))
    results, _ = _run(engine, prompts)
    assert replays  # decodes went through the graphs
    for (ids, features), (ours, _) in zip(prompts, results, strict=True):
        _assert_matches(ours, _hf_greedy(qwen2_vl, ids, features))


def test_profile_run_encodes_the_largest_images(qwen2_vl: tuple) -> None:
    engine = _engine(qwen2_vl, max_num_batched_tokens=120)
    runner = engine.model_runner
    # The tiny preset's max_pixels is 16 tokens of 28 x 28, but an image at the aspect limit (200) keeps a 28-pixel
    # short side: floor(sqrt(200 * 12544) / 28) = 56 tokens.
    assert runner.model.max_tokens_per_mm_item == 56
    assert [tuple(o.shape) for o in runner._profile_encoder()] == [(56, 64)] * 2  # 120 // 56 images
    runner.profile_run()
    assert runner.num_encoder_calls == 0 and runner.encoder_cache == {}


def test_invalid_image_items_are_refused(qwen2_vl: tuple) -> None:
    ids, [feature] = build_prompt(qwen2_vl, [0])
    engine = _engine(qwen2_vl)
    grid, pixels = feature.data["image_grid_thw"], feature.data["pixel_values"]
    odd_grid = np.array([1, 3, 8], dtype=np.int64)  # h not a multiple of the merge size 2
    big_grid = np.array([1, 8, 30], dtype=np.int64)  # 60 tokens, past the tiny preset's 56
    cases = {
        "data['image_grid_thw'] is missing": replace(feature, data={"pixel_values": pixels}),
        "data['image_grid_thw'] has dtype": replace(
            feature, data={**feature.data, "image_grid_thw": replace(grid, dtype="int32", data=grid.data[:12])}
        ),
        "multiples of 2": replace(
            feature, data={**feature.data, "image_grid_thw": replace(grid, data=odd_grid.tobytes())}
        ),
        "data['pixel_values'] has shape": replace(
            feature, data={**feature.data, "pixel_values": replace(pixels, shape=(pixels.shape[0] - 1, 1176))}
        ),
        "length 6: grid [1, 4, 8] makes 8 placeholder tokens": replace(
            feature,
            data={
                "image_grid_thw": replace(grid, data=np.array([1, 4, 8], dtype=np.int64).tobytes()),
                "pixel_values": MultiModalTensor("float32", (32, 1176), bytes(4 * 32 * 1176)),
            },
        ),
        "is not supported by Qwen2-VL": replace(feature, modality="audio"),
    }
    big = MultiModalFeature(
        "image",
        "big",
        feature.offset,
        60,
        {
            "image_grid_thw": replace(grid, data=big_grid.tobytes()),
            "pixel_values": MultiModalTensor("float32", (240, 1176), bytes(4 * 240 * 1176)),
        },
    )
    big_ids = ids[: feature.offset] + [ids[feature.offset]] * 60 + ids[feature.offset + feature.length :]
    requests = [(expected, ids, bad) for expected, bad in cases.items()]
    requests.append(("larger than this model's largest image (56 tokens", big_ids, big))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for expected, prompt, bad in requests:
        with pytest.raises(InvalidRequestError, match=re.escape(expected)) as info:
            engine.add_request(Request(f"bad-{len(expected)}", prompt, params, mm_features=[bad]))
        assert info.value.field == "mm_features[0]", expected
