"""Qwen2-VL against transformers on the same seeded checkpoint, float32: the vision tower, M-RoPE positions, and
the language model's logits over merged image embeddings through a paged KV cache (chunked prefill, then decode)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from core_svc.model_loader import load_hf_config, load_model
from core_svc.models.mrope import get_mrope_input_positions, mrope_decode_positions, mrope_positions
from core_svc.models.qwen2_vl import Qwen2VLForConditionalGeneration, image_max_pixels
from core_svc.request import MultiModalFeature, MultiModalTensor
from kernels import AttentionMetadata, get_attention_backend
from tests.conftest import real_or_builtin
from tests.helpers import make_engine, run_engine

BLOCK_SIZE = 4
IMAGE_SIZES = [(50, 90), (120, 60), (30, 30)]  # (height, width): landscape, portrait, square below min_pixels


_BUILT: dict[str, tuple] = {}


def _build(arch: str, tmp_path_factory) -> tuple:
    """(path, transformers model, our model, image processor, tokenizer) of a tiny random checkpoint of ``arch``."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    from splitserve.entrypoints.test_model import make_test_model

    if arch not in _BUILT:
        path = make_test_model(tmp_path_factory.mktemp(arch), arch=arch, tokenizer=real_or_builtin("llama2"))
        hf_class = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
        hf = hf_class.from_pretrained(path, dtype=torch.float32).eval()
        backend = get_attention_backend("torch_ref", "cpu", None)
        ours = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), backend).model
        assert isinstance(ours, Qwen2VLForConditionalGeneration)
        _BUILT[arch] = (path, hf, ours, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    return _BUILT[arch]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    """A tiny random Qwen2-VL, then Qwen2.5-VL (window attention in its tower): see ``_build``."""
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return _build("qwen2_vl", tmp_path_factory)


def random_image(index: int) -> Image.Image:
    height, width = IMAGE_SIZES[index]
    pixels = np.random.RandomState(index).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_feature(processor, index: int, offset: int) -> MultiModalFeature:
    """One image item as the frontend sends it: the processor's tensors for that image alone, as bytes."""
    out = processor(images=[random_image(index)], return_tensors="np")
    pixel_values = out["pixel_values"].astype(np.float32)
    grid = out["image_grid_thw"][0].astype(np.int64)
    return MultiModalFeature(
        modality="image",
        identifier=f"image-{index}",
        offset=offset,
        length=int(grid.prod()) // 4,
        data={
            "pixel_values": MultiModalTensor("float32", pixel_values.shape, pixel_values.tobytes()),
            "image_grid_thw": MultiModalTensor("int64", grid.shape, grid.tobytes()),
        },
    )


def build_prompt(vl, image_indices: list[int]) -> tuple[list[int], list[MultiModalFeature]]:
    """Token ids of "<bos>Look: [<vision_start><image_pad>*n<vision_end> and]... what?" and its image items."""
    _, hf, _, processor, tokenizer = vl
    cfg = hf.config
    ids = [tokenizer.bos_token_id, *tokenizer.encode("Look:", add_special_tokens=False)]
    features = []
    for index in image_indices:
        ids.append(cfg.vision_start_token_id)
        feature = image_feature(processor, index, len(ids))
        ids += [cfg.image_token_id] * feature.length + [cfg.vision_end_token_id]
        ids += tokenizer.encode(" and", add_special_tokens=False)
        features.append(feature)
    ids += tokenizer.encode(" what is it?", add_special_tokens=False)
    return ids, features


def hf_inputs(vl, ids: list[int], features: list[MultiModalFeature]) -> dict:
    _, hf, _, processor, _ = vl
    input_ids = torch.tensor([ids])
    inputs: dict = {"input_ids": input_ids, "mm_token_type_ids": (input_ids == hf.config.image_token_id).int()}
    if features:
        out = processor(images=[random_image(int(f.identifier.split("-")[1])) for f in features], return_tensors="pt")
        inputs |= {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return inputs


def test_checkpoint_files_load_with_transformers(vl):
    path, hf, ours, processor, tokenizer = vl
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>") == hf.config.image_token_id
    assert config["vision_start_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config["vision_end_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    processor_class = json.loads((path / "processor_config.json").read_text())["processor_class"]
    assert processor_class == config["architectures"][0].replace("ForConditionalGeneration", "Processor")
    assert (ours.vision_cfg.window_size is not None) == (processor_class == "Qwen2_5_VLProcessor")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is it?" in text
    grids = [processor(images=[random_image(i)])["image_grid_thw"][0] for i in range(len(IMAGE_SIZES))]
    # min_pixels / max_pixels of the tiny preset: 4 to 16 merged tokens (16 to 64 patches of 14 x 14) per image.
    assert [int(np.prod(g)) for g in grids] == [24, 32, 16]


@pytest.mark.parametrize("image_indices", [[0], [0, 1], [1, 2, 0]])
def test_vision_tower_matches_transformers(vl, image_indices):
    _, hf, ours, processor, _ = vl
    out = processor(images=[random_image(i) for i in image_indices], return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.visual(out["pixel_values"], grid_thw=out["image_grid_thw"]).pooler_output
        actual = ours.visual(out["pixel_values"], out["image_grid_thw"])
    assert actual.shape == expected.shape == (int(out["image_grid_thw"].prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_embed_multimodal_is_the_items_rows_of_the_tower(vl):
    _, hf, ours, processor, _ = vl
    features = [image_feature(processor, i, 0) for i in (0, 1)]
    out = processor(images=[random_image(0), random_image(1)], return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.visual(out["pixel_values"], grid_thw=out["image_grid_thw"]).pooler_output
        actual = torch.cat([ours.embed_multimodal(f) for f in features])
    assert [f.length for f in features] == [6, 8]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_embed_multimodal_rejects_a_wrong_placeholder_length(qwen2_vl):
    _, _, ours, processor, _ = qwen2_vl
    feature = image_feature(processor, 0, 0)
    wrong = MultiModalFeature("image", "x", 0, feature.length + 1, feature.data)
    with pytest.raises(ValueError, match="placeholder range has 7"):
        ours.embed_multimodal(wrong)


@pytest.mark.parametrize("image_indices", [[], [0], [1, 2]])
def test_mrope_positions_match_get_rope_index(vl, image_indices):
    _, hf, ours, _, _ = vl
    ids, features = build_prompt(vl, image_indices)
    inputs = hf_inputs(vl, ids, features)
    expected, expected_delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw")
    )
    positions, delta = ours.get_mrope_input_positions(len(ids), features)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta) == int(positions.max()) + 1 - len(ids)
    assert (delta < 0) == bool(image_indices)


def test_checkpoint_names_of_both_layouts_map_to_our_parameters(qwen2_vl):
    """The saved layout (``visual.``, ``model.layers``) and transformers' in-memory one (``model.visual.``,
    ``model.language_model.``) name the same parameters; q/k/v and gate/up of the decoder fill fused shards."""
    ours = qwen2_vl[2]
    for saved, in_memory, expected in [
        (
            "visual.blocks.0.attn.qkv.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            ("visual.blocks.0.attn.qkv.weight", None),
        ),
        (
            "model.layers.1.self_attn.k_proj.bias",
            "model.language_model.layers.1.self_attn.k_proj.bias",
            ("model.layers.1.self_attn.qkv_proj.bias", 1),
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            "model.language_model.layers.0.mlp.up_proj.weight",
            ("model.layers.0.mlp.gate_up_proj.weight", 1),
        ),
        ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", ("model.embed_tokens.weight", None)),
    ]:
        assert ours.checkpoint_param_name(saved) == ours.checkpoint_param_name(in_memory) == expected
        module_name, attribute = expected[0].rsplit(".", 1)
        assert hasattr(
            ours.get_submodule(module_name), attribute
        )  # a prepacked Linear keeps its module, not its weight


def test_mrope_positions_of_a_hand_worked_prompt():
    # 2 text tokens, a 2x3 merged grid (patch grid 1x4x6) at offset 2, then 1 text token.
    positions, delta = get_mrope_input_positions(9, [(2, (1, 4, 6))], spatial_merge_size=2)
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert delta == 6 - 9
    assert mrope_decode_positions(delta, 9, 11).tolist() == [[6, 7]] * 3


def test_mrope_positions_of_a_span_across_prompt_and_outputs():
    positions, delta = get_mrope_input_positions(9, [(2, (1, 4, 6))], spatial_merge_size=2)
    assert torch.equal(mrope_positions(positions, delta, 3, 7), positions[:, 3:7])
    assert mrope_positions(positions, delta, 7, 11).tolist() == [[2, 5, 6, 7], [3, 5, 6, 7], [4, 5, 6, 7]]
    assert mrope_positions(positions, delta, 10, 11).tolist() == [[7]] * 3


def test_mrope_positions_reject_overlapping_images():
    with pytest.raises(ValueError, match="overlap"):
        get_mrope_input_positions(20, [(2, (1, 4, 4)), (4, (1, 4, 4))], spatial_merge_size=2)


def _metadata(start: int, end: int, num_blocks: int) -> AttentionMetadata:
    """One request computing tokens start..end-1 over blocks 1..num_blocks (block 0 is the null block)."""
    slots = [(1 + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_table=torch.arange(1, num_blocks + 1, dtype=torch.int32)[None],
        query_start_loc_cpu=[0, end - start],
        seq_lens_cpu=[end],
        max_query_len=end - start,
        max_seq_len=end,
        num_decodes=int(end - start == 1),
    )


def _inputs_embeds(model, ids: list[int], features: list[MultiModalFeature], start: int, end: int) -> torch.Tensor:
    """What the model runner feeds for tokens start..end-1: token embeddings with each image's rows over its
    placeholder range (the part of it inside the chunk)."""
    embeds = model.embed_input_ids(torch.tensor(ids[start:end]))
    for feature in features:
        lo, hi = max(start, feature.offset), min(end, feature.offset + feature.length)
        if lo < hi:
            embeds[lo - start : hi - start] = model.embed_multimodal(feature)[lo - feature.offset : hi - feature.offset]
    return embeds


@pytest.mark.parametrize("image_indices", [[0], [1, 0]])
def test_logits_match_transformers_through_the_paged_cache(vl, image_indices):
    """A prompt prefilled in two chunks (the cut inside the last image's placeholders), then one decode step at
    position ``len + delta``: every row's logits equal transformers' on the same input_ids + pixel_values."""
    _, hf, ours, _, _ = vl
    ids, features = build_prompt(vl, image_indices)
    with torch.no_grad():
        expected = hf(**hf_inputs(vl, ids, features)).logits[0]
    next_id = int(expected[-1].argmax())
    with torch.no_grad():
        expected_next = hf(**hf_inputs(vl, [*ids, next_id], features)).logits[0, -1]

    cfg = ours.cfg
    num_blocks = -(-(len(ids) + 1) // BLOCK_SIZE)
    kv_caches = [
        torch.zeros(2, num_blocks + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_size)
        for _ in range(cfg.num_hidden_layers)
    ]
    positions, delta = ours.get_mrope_input_positions(len(ids), features)
    cut = features[-1].offset + 3
    logits = []
    with torch.no_grad():
        for start, end in [(0, cut), (cut, len(ids))]:
            embeds = _inputs_embeds(ours, ids, features, start, end)
            hidden = ours(
                torch.tensor(ids[start:end]),
                positions[:, start:end],
                kv_caches,
                _metadata(start, end, num_blocks),
                embeds,
            )
            logits.append(ours.compute_logits(hidden))
        decode_positions = mrope_decode_positions(delta, len(ids), len(ids) + 1)
        hidden = ours(
            torch.tensor([next_id]), decode_positions, kv_caches, _metadata(len(ids), len(ids) + 1, num_blocks)
        )
        next_logits = ours.compute_logits(hidden)[0]
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(next_logits, expected_next, atol=1e-4, rtol=0)


def test_text_positions_would_not_match(qwen2_vl):
    """The logits test can fail: 1-D text positions in place of M-RoPE's move the logits far beyond its tolerance."""
    _, hf, ours, _, _ = qwen2_vl
    ids, features = build_prompt(qwen2_vl, [0])
    with torch.no_grad():
        expected = hf(**hf_inputs(qwen2_vl, ids, features)).logits[0]
    cfg = ours.cfg
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv_caches = [
        torch.zeros(2, num_blocks + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_size)
        for _ in range(cfg.num_hidden_layers)
    ]
    with torch.no_grad():
        embeds = _inputs_embeds(ours, ids, features, 0, len(ids))
        hidden = ours(torch.tensor(ids), torch.arange(len(ids)), kv_caches, _metadata(0, len(ids), num_blocks), embeds)
    assert (ours.compute_logits(hidden) - expected).abs().max() > 1e-2


def test_engine_serves_text_prompts_as_transformers_generates(qwen2_vl):
    """Text prompts through the engine: their M-RoPE positions are equal in all three streams, with delta 0.
    Greedy ids equal transformers ``generate`` (image requests: ``test_qwen2_vl_engine.py``)."""
    path, hf, _, _, _ = qwen2_vl
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.text_config.vocab_size, (n,), generator=generator).tolist() for n in (5, 40)]
    results, _ = run_engine(make_engine(path), prompts, 16)
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
            )
        assert result.token_ids == out[0, len(prompt) :].tolist()


def test_vision_window_index_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    from core_svc.models.qwen2_vl import Qwen2VisionConfig, vision_window_index

    cfg = Qwen2VisionConfig(2, 32, 64, "silu", 64, 2, 3, 14, 2, 2, 10000.0, True, True, 112, (1,))
    # merged grids 2x3 (windows of 4x4 merged tokens: one partial), 10x6 (partial rows and columns), 8x8 (exact)
    grid_thw = torch.tensor([[1, 4, 6], [2, 20, 12], [1, 16, 16]])
    expected_index, expected_cu = get_vision_window_index(grid_thw, 2, window_size=112, patch_size=14)
    index, cu_seqlens = vision_window_index(grid_thw, cfg)
    assert torch.equal(index, expected_index)
    assert cu_seqlens == expected_cu.tolist()


def test_make_test_model_refuses_a_preset_without_a_vl_shape_before_writing(tmp_path):
    from splitserve.entrypoints.test_model import make_test_model

    with pytest.raises(ValueError, match="presets tiny, not 'small'"):
        make_test_model(tmp_path / "out", arch="qwen2_vl", preset="small")
    assert not (tmp_path / "out").exists()


def test_max_pixels_overrides_size_longest_edge_as_in_transformers():
    from transformers import Qwen2VLImageProcessor

    config = {"size": {"shortest_edge": 3136, "longest_edge": 12544}, "max_pixels": 1568, "min_pixels": 3136}
    theirs = Qwen2VLImageProcessor(**config)
    assert image_max_pixels(config) == theirs.size["longest_edge"] == 1568
    assert image_max_pixels({"size": {"shortest_edge": 3136, "longest_edge": 12544}}) == 12544
    assert image_max_pixels({}) == 28 * 28 * 1280


RATIOS = (1, 3, 50, 150, 199.5, 200)


@pytest.mark.parametrize(
    ("min_pixels", "max_pixels", "expected"),
    [(3136, 12544, 56), (3136, 128 * 784, 160), (3136, 3136, 29), (3136, 28 * 28 * 1280, 1280)],
)
def test_the_largest_image_is_the_most_tokens_smart_resize_makes(min_pixels, max_pixels, expected):
    """An image at the aspect-ratio limit keeps a short side of one unit (28 pixels), so its long side can make
    more tokens than max_pixels // 28**2 (a 1000 x 20 banner: 28 tokens under a 16-token max_pixels): the bound
    is the most transformers' own smart_resize makes of any image up to that ratio."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from core_svc.image_processor_config import ImageProcessorConfig

    sizes = [(short, int(short * ratio)) for short in [*range(1, 60), *range(60, 2000, 37)] for ratio in RATIOS]
    sizes.append((20 * 28, 64 * 28))  # exactly 1280 tokens of 28 x 28 pixels: the default max_pixels
    most = 0
    for short, long in sizes:
        height, width = smart_resize(short, long, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
        most = max(most, height * width // 28**2)
    bound = ImageProcessorConfig({"min_pixels": min_pixels, "max_pixels": max_pixels}, "t").max_image_tokens(28, 0)
    assert bound == most == expected
