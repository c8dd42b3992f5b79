"""LLaVA-1.5 end to end in the engine core: greedy ids equal transformers' ``LlavaForConditionalGeneration``
(float32, same random checkpoint, inputs made by its own ``LlavaProcessor``); encoder scheduling, cache and
merge; validation of ``mm_features``."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from core_svc.engine_core import EngineCore
from core_svc.errors import EngineStepError, InvalidRequestError
from core_svc.request import MultiModalFeature, MultiModalTensor, Request
from core_svc.sampling_params import SamplingParams
from splitserve.base.status import StatusCode
from tests.conftest import real_or_builtin
from tests.helpers import features_from_the_wire, make_engine

MAX_TOKENS = 6
# Solid colours and a gradient, of different sizes and aspect ratios (the processor resizes and crops them).
# Random-noise images all look alike to a random CLIP tower; these do not.
IMAGE_SPECS = [((60, 40), (255, 0, 0)), ((30, 50), (0, 0, 255)), ((33, 33), None)]


@pytest.fixture(scope="module")
def llava(checkpoint: Any) -> Path:
    return checkpoint("llava", tokenizer=real_or_builtin("llama2"))  # type: ignore[no-any-return]  # fixture


@cache
def _processor(path: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


@cache
def _hf_model(path: Path) -> Any:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _image(index: int) -> Any:
    from PIL import Image

    size, colour = IMAGE_SPECS[index]
    if colour is not None:
        return Image.new("RGB", size, colour)
    ramp = np.zeros((size[1], size[0], 3), np.uint8)  # red rising left to right, green falling top to bottom
    ramp[:, :, 0] = np.linspace(0, 255, size[0])[None, :]
    ramp[:, :, 1] = np.linspace(255, 0, size[1])[:, None]
    return Image.fromarray(ramp)


def _inputs(path: Path, text: str, images: list[int]) -> tuple[list[int], list[MultiModalFeature], np.ndarray]:
    """The processor's input_ids and one MultiModalFeature per image (its pixel_values, a hash of them, the
    placeholder run in the prompt); pixel_values [num_images, 3, H, W] for transformers."""
    processor = _processor(path)
    batch = processor(images=[_image(i) for i in images], text=text, return_tensors="np")
    ids: list[int] = batch["input_ids"][0].tolist()
    pixel_values = batch["pixel_values"].astype(np.float32)
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    starts = [i for i, t in enumerate(ids) if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]
    length = next(n for n, t in enumerate(ids[starts[0] :]) if t != image_token_id)  # one image's run
    features = [
        MultiModalFeature(
            modality="image",
            identifier=hashlib.sha256(pixels.tobytes()).hexdigest(),
            offset=start,
            length=length,
            data={"pixel_values": MultiModalTensor("float32", tuple(pixels.shape), pixels.astype("<f4").tobytes())},
        )
        for start, pixels in zip(starts, pixel_values, strict=True)
    ]
    return ids, features, pixel_values


def _hf_greedy(path: Path, ids: list[int], pixel_values: np.ndarray | None) -> list[int]:
    kwargs = {} if pixel_values is None else {"pixel_values": torch.from_numpy(pixel_values)}
    with torch.no_grad():
        out = _hf_model(path).generate(
            input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[0, len(ids) :].tolist()  # type: ignore[no-any-return]  # a list of ints


def _run(engine: EngineCore, requests: list[tuple[list[int], list[MultiModalFeature]]]) -> list[tuple[list[int], int]]:
    """Greedy ids and num_cached_tokens of each (prompt, features), all added at once."""
    results: dict[str, tuple[list[int], int]] = {}
    for i, (ids, features) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        engine.add_request(Request(f"r{i}-{id(results)}", ids, params, mm_features=features))
        results[f"r{i}-{id(results)}"] = ([], 0)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.num_cached_tokens)
    return list(results.values())


def test_checkpoint_and_processor_agree(llava: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llava)
    processor = _processor(llava)
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == config.image_token_index
    assert (
        processor.image_processor.crop_size
        == {"height": 32, "width": 32}
        == {
            "height": config.vision_config.image_size,
            "width": config.vision_config.image_size,
        }
    )
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "USER: <image>\nHi ASSISTANT:"
    ids, [feature], _ = _inputs(llava, text, [1])
    assert feature.length == config.image_seq_length == ids.count(config.image_token_index)


PROMPT = "USER: <image>\nWhat is shown in this picture, in a few words? ASSISTANT:"


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_one_image_matches_transformers(llava: Path, backend: str) -> None:
    for image in range(3):
        ids, features, pixel_values = _inputs(llava, PROMPT, [image])
        engine = make_engine(llava, attention_backend=backend, num_kv_blocks=64)
        [(ours, _)] = _run(engine, [(ids, features)])
        assert ours == _hf_greedy(llava, ids, pixel_values), f"image {image}"
        assert engine.model_runner.num_encoder_calls == 1


def test_images_change_the_output(llava: Path) -> None:
    # Guards the other tests: if every image gave the same next-token logits, a wrong merge could pass them.
    # (Logits, not greedy ids: whether ids differ depends on the tokenizer the checkpoint was built with.)
    logits = []
    for i in range(3):
        ids, _, pixel_values = _inputs(llava, PROMPT, [i])
        with torch.no_grad():
            out = _hf_model(llava)(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixel_values))
        logits.append(out.logits[0, -1])
    for a in range(3):
        for b in range(a + 1, 3):
            assert (logits[a] - logits[b]).abs().max() > 1e-2, (a, b)


def test_two_images_in_one_prompt(llava: Path) -> None:
    ids, features, pixel_values = _inputs(llava, "USER: <image>\nand <image>\nCompare them. ASSISTANT:", [0, 2])
    assert len(features) == 2
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64)
    [(ours, _)] = _run(engine, [(ids, features)])
    assert ours == _hf_greedy(llava, ids, pixel_values)


def test_one_client_identifier_for_two_images_keys_nothing(llava: Path) -> None:
    # A client reuses one identifier for other pixels: the core's own content hash keeps the encoder and prefix
    # caches apart, and each request's ids are its own image's.
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64)
    inputs = [_inputs(llava, PROMPT, [i]) for i in (0, 1)]
    requests = [(ids, features_from_the_wire(features, "same")) for ids, features, _ in inputs]
    assert [tokens for tokens, _ in _run(engine, requests)] == [_hf_greedy(llava, ids, px) for ids, _, px in inputs]
    assert requests[0][1][0].identifier != requests[1][1][0].identifier
    assert engine.model_runner.num_encoder_calls == 2


def test_an_item_of_the_wrong_number_of_rows_fails_its_request_alone(
    llava: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64)
    (good_ids, good, pixel_values), (bad_ids, bad, _) = [_inputs(llava, PROMPT, [i]) for i in (0, 1)]
    encode = engine.model_runner._encode
    monkeypatch.setattr(  # the encoder gives image 1 a row short of its placeholder run
        engine.model_runner,
        "_encode",
        lambda features: [e[:-1] if f == bad[0] else e for f, e in zip(features, encode(features), strict=True)],
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("good", good_ids, params, mm_features=good))
    engine.add_request(Request("bad", bad_ids, params, mm_features=bad))
    tokens: dict[str, list[int]] = {"good": [], "bad": []}
    errors: dict[str, Exception] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.error is not None:
                errors[output.request_id] = output.error
    assert tokens == {"good": _hf_greedy(llava, good_ids, pixel_values), "bad": []}
    assert list(errors) == ["bad"] and "15 embedding rows for 16 placeholder tokens" in str(errors["bad"])
    assert isinstance(errors["bad"], EngineStepError)  # INTERNAL
    assert engine.num_consecutive_failed_steps == 0


@pytest.mark.parametrize(("max_num_batched_tokens", "threshold"), [(7, 0), (64, 5)])
def test_chunked_prefill_inside_an_image(llava: Path, max_num_batched_tokens: int, threshold: int) -> None:
    # Chunks of 7 (or 5) tokens start and end inside each 16-token placeholder run: exact slices are merged.
    ids, features, pixel_values = _inputs(llava, "USER: <image>\nand <image>\nCompare them. ASSISTANT:", [1, 0])
    engine = make_engine(
        llava,
        attention_backend="torch_ref",
        num_kv_blocks=64,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=threshold,
    )
    [(ours, _)] = _run(engine, [(ids, features)])
    assert ours == _hf_greedy(llava, ids, pixel_values)
    assert engine.model_runner.num_encoder_calls == 2  # each image once, reused by the chunks after


def test_prefix_cache_hit_and_no_false_hit(llava: Path) -> None:
    text = "USER: <image>\nDescribe the colours and the shapes of this picture in detail please. ASSISTANT:"
    ids, features, pixel_values = _inputs(llava, text, [0])
    other_ids, other_features, other_pixels = _inputs(llava, text, [1])
    assert ids == other_ids
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64, block_size=4)
    [(first, cached_first)] = _run(engine, [(ids, features)])
    [(again, cached_again)] = _run(engine, [(ids, features)])
    assert cached_first == 0 and cached_again > features[0].offset + features[0].length
    assert first == again == _hf_greedy(llava, ids, pixel_values)
    assert engine.model_runner.num_encoder_calls == 1  # the image lies in cached blocks: not encoded again
    # Same text, another image: only the blocks before the image may hit.
    [(other, cached_other)] = _run(engine, [(other_ids, other_features)])
    assert cached_other <= features[0].offset  # no false hit: nothing from the image on was reused
    assert other == _hf_greedy(llava, other_ids, other_pixels)


def test_prefix_cache_hit_ending_inside_the_image(llava: Path) -> None:
    # 16-token blocks: the hit covers block 0, which holds the image's first rows; the rest of the image is
    # computed from a slice of its embedding.
    ids, features, pixel_values = _inputs(llava, "USER: <image>\nHi ASSISTANT:", [1])
    engine = make_engine(llava, attention_backend="cpu", num_kv_blocks=64, enable_prefix_caching=True)
    _run(engine, [(ids, features)])
    [(again, cached)] = _run(engine, [(ids, features)])
    assert features[0].offset < cached < features[0].offset + features[0].length
    assert again == _hf_greedy(llava, ids, pixel_values)


def test_encoder_cache_shared_then_freed(llava: Path) -> None:
    ids, features, _ = _inputs(llava, PROMPT, [2])
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64, enable_prefix_caching=False)
    results = _run(engine, [(ids, features), (ids, features)])
    assert results[0][0] == results[1][0]
    assert engine.model_runner.num_encoder_calls == 1  # two requests, one image: encoded once
    cache_manager = engine.scheduler.encoder_cache_manager
    identifier = features[0].identifier
    assert cache_manager.cached[identifier] == set()  # nobody references it any more ...
    assert identifier in cache_manager.freeable  # ... it stays reusable until space is needed
    assert cache_manager.num_freeable_slots == cache_manager.cache_size
    [(again, _)] = _run(engine, [(ids, features)])
    assert again == results[0][0] and engine.model_runner.num_encoder_calls == 1


def test_mixed_batch_of_text_and_image_requests(llava: Path) -> None:
    ids, features, pixel_values = _inputs(llava, PROMPT, [0])
    text_ids = _processor(llava).tokenizer("USER: Tell me a story about a cat. ASSISTANT:")["input_ids"]
    engine = make_engine(llava, attention_backend="cpu", num_kv_blocks=64)
    results = _run(engine, [(text_ids, []), (ids, features), (list(text_ids[:-2]), [])])
    assert results[0][0] == _hf_greedy(llava, text_ids, None)
    assert results[1][0] == _hf_greedy(llava, ids, pixel_values)
    assert results[2][0] == _hf_greedy(llava, list(text_ids[:-2]), None)


def _refusal(engine: EngineCore, ids: list[int], features: list[MultiModalFeature]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request(f"bad-{id(features)}-{len(ids)}", ids, params, mm_features=features))
    assert info.value.field.startswith("mm_features")
    assert info.value.status_code == StatusCode.INVALID_ARGUMENT
    return str(info.value)


def test_invalid_mm_features_are_refused(llava: Path, checkpoint: Any) -> None:
    ids, [feature], _ = _inputs(llava, PROMPT, [0])
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64)
    pixels = feature.data["pixel_values"]
    cases = {
        "not inside the prompt": [replace(feature, offset=len(ids) - 4)],
        "not the model's image token": [replace(feature, offset=feature.offset - 1)],
        "items cover 0": [],
        "overlaps": [replace(feature, length=8), replace(feature, offset=feature.offset + 4, length=12)],
        "is missing": [replace(feature, data={})],
        "has shape": [replace(feature, data={"pixel_values": replace(pixels, shape=(3, 16, 64))})],
        "has dtype": [replace(feature, data={"pixel_values": replace(pixels, dtype="int64")})],
        "bytes": [replace(feature, data={"pixel_values": replace(pixels, data=pixels.data[:-4])})],
        "modality": [replace(feature, modality="audio")],
    }
    for expected, features in cases.items():
        assert expected in _refusal(engine, ids, features), expected
    text_model = make_engine(checkpoint("llama"), num_kv_blocks=16)
    assert "takes no multimodal input" in _refusal(text_model, [1, 2, 3], [replace(feature, offset=0, length=2)])


def test_more_images_than_the_cores_limit_are_refused(llava: Path) -> None:
    """The core's own --limit-mm-per-prompt (a client of the core other than our frontend, or a frontend started
    with another limit): a request with more items is INVALID_ARGUMENT naming the limit; as many are taken."""
    ids, features, _ = _inputs(llava, "USER: <image> and <image>? ASSISTANT:", [0, 1])
    limited = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64, limit_mm_per_prompt="image=1")
    message = _refusal(limited, ids, features)
    assert message == (
        "mm_features: has 2 images, more than the 1 a prompt may hold (the engine core's --limit-mm-per-prompt image=1)"
    )
    enough = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64, limit_mm_per_prompt='{"image": 2}')
    enough.add_request(Request("two", ids, SamplingParams(temperature=0.0, max_tokens=2), mm_features=features))
    assert enough.scheduler.get_num_unfinished_requests() == 1


def test_preemption_recomputes_image_requests(llava: Path) -> None:
    # A KV cache too small for both requests at full length: one is preempted and recomputed (its image from
    # the encoder cache or encoded again), with the same ids as transformers.
    inputs = [_inputs(llava, PROMPT, [i]) for i in (0, 1)]
    # Room for both prompts and nothing more (the prompts have one length): the first block either needs for
    # its outputs preempts the other (MAX_TOKENS - 1 > 3 slots left in a prompt's last block).
    prompt_blocks = -(-len(inputs[0][0]) // 4)
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=2 * prompt_blocks + 1, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (ids, features, _) in enumerate(inputs):
        engine.add_request(Request(f"p{i}", ids, params, mm_features=features))
    tokens: dict[str, list[int]] = {"p0": [], "p1": []}
    num_preemptions = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_preemptions += outputs.scheduler_stats.num_preemptions if outputs.scheduler_stats else 0
        for output in outputs.outputs:
            tokens[output.request_id] += output.new_token_ids
    assert num_preemptions > 0
    for i, (ids, _, pixel_values) in enumerate(inputs):
        assert tokens[f"p{i}"] == _hf_greedy(llava, ids, pixel_values)


def test_image_request_through_the_core_edge(llava: Path) -> None:
    # As a frontend sends it: protobuf in (core_svc.wire), protobuf out; a bad item refused with its field.
    from core_svc.inproc import InprocCore, RefusedError
    from splitserve.stubs.engine.v1 import engine_core_pb2 as pb

    ids, [feature], pixel_values = _inputs(llava, PROMPT, [2])
    pixels = feature.data["pixel_values"]
    item = pb.MultiModalFeatureSpec(
        modality="image",
        identifier=feature.identifier,
        offset=feature.offset,
        length=feature.length,
        data={"pixel_values": pb.TensorData(dtype=pixels.dtype, shape=list(pixels.shape), data=pixels.data)},
    )
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core = InprocCore(str(llava), attention_backend="torch_ref", num_kv_blocks=64)
    core.add_request(
        pb.EngineCoreRequest(request_id="ok", prompt_token_ids=ids, mm_features=[item], sampling_params=params)
    )
    tokens: list[int] = []
    while core.engine_core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens += output.new_token_ids
    assert tokens == _hf_greedy(llava, ids, pixel_values)
    item.data["pixel_values"].shape[:] = [3, 16, 64]
    with pytest.raises(RefusedError) as info:
        core.add_request(
            pb.EngineCoreRequest(request_id="bad", prompt_token_ids=ids, mm_features=[item], sampling_params=params)
        )
    assert info.value.error.code == StatusCode.INVALID_ARGUMENT
    assert info.value.error.field == "mm_features[0]"


def test_profile_run_encodes_a_full_encoder_budget(llava: Path) -> None:
    engine = make_engine(llava, attention_backend="torch_ref", num_kv_blocks=64, max_num_batched_tokens=40)
    runner = engine.model_runner
    outputs = runner._profile_encoder()
    assert [tuple(o.shape) for o in outputs] == [(16, 64), (16, 64)]  # 40 // 16 images of 16 rows
    runner.profile_run()  # the forward and sampler after it, as on CUDA before sizing the KV cache
    assert runner.num_encoder_calls == 0 and runner.encoder_cache == {}  # nothing of it is kept
