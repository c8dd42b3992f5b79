"""The engine core against transformers on the same seeded checkpoints, float32: greedy ids, logprobs and prompt
logprobs, with staggered arrivals, forced chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from core_svc.models.layers import Linear, compiled_gemv
from tests.conftest import report_divergence
from tests.helpers import first_divergence, hf_greedy, hf_model, make_engine, run_engine

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_NEW_TOKENS = 48
PROMPT_LENS = [1, 7, 33, 64, 150, 300]
ARRIVAL_STEPS = [0, 0, 2, 2, 5, 9]
LLAMA3_ROPE = {
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def random_prompts(vocab_size: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts sharing a 100-token prefix (and two sharing 140), with different tails."""
    base, tails = random_prompts(vocab_size, [100], seed=1)[0], random_prompts(vocab_size, [3, 40, 57, 9], seed=2)
    return [base + tails[0], base + tails[1], base + tails[1][:40] + tails[2], base + tails[3]]


_REFERENCES: dict[tuple, list] = {}


def references(path, prompts: list[list[int]]) -> list:
    key = (str(path), tuple(map(tuple, prompts)))
    if key not in _REFERENCES:
        _REFERENCES[key] = [hf_greedy(path, p, MAX_NEW_TOKENS) for p in prompts]
    return _REFERENCES[key]


def assert_matches(name: str, results, refs) -> None:
    divergences = 0
    for i, (ours, ref) in enumerate(zip(results, refs, strict=True)):
        assert len(ours.token_ids) == MAX_NEW_TOKENS and ours.finish_reason == "length"
        note = first_divergence(ours, ref)
        if note is not None:
            divergences += 1
            report_divergence(f"{name} prompt {i}: {note}")
    # A near-tie can flip one greedy choice; more than one per scenario would mean a real difference.
    assert divergences <= 1, f"{name}: {divergences} of {len(refs)} sequences diverged"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_staggered_arrivals(checkpoint, arch):
    path = checkpoint(arch)
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)
    results, _ = run_engine(make_engine(path), prompts, MAX_NEW_TOKENS, ARRIVAL_STEPS)
    assert_matches(f"{arch}/staggered", results, references(path, prompts))


def test_greedy_matches_transformers_with_dense_decode_weights(checkpoint):
    """``dense_decode_weights``: steps of at most a few rows (each prompt alone, then the staggered batch as it
    drains) use the dense weights, larger ones the batch layout (panels, or column-major without the panel kernel).
    One architecture: the choice is made in the
    shared ``Linear`` (``tests/test_layers.py`` checks its values), the same for every model."""
    arch = "llama"
    path = checkpoint(arch)
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)
    engine = make_engine(path, dense_decode_weights=True)
    decoder = [m for n, m in engine.model_runner.model.named_modules() if isinstance(m, Linear) and n != "lm_head"]
    if compiled_gemv(torch.float32) is None:
        pytest.skip("no compiled float32 matrix-vector kernel here (it needs AVX-512F): no dense copies are kept")
    assert all(m.dense_weight is not None for m in decoder)
    assert all(m.panel_weight is not None or m.weight.t().is_contiguous() for m in decoder)
    alone = [run_engine(engine, [prompt], MAX_NEW_TOKENS)[0][0] for prompt in prompts[:3]]
    assert_matches(f"{arch}/dense alone", alone, references(path, prompts)[:3])
    results, _ = run_engine(engine, prompts, MAX_NEW_TOKENS, ARRIVAL_STEPS)
    assert_matches(f"{arch}/dense staggered", results, references(path, prompts))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_chunked_prefill(checkpoint, arch):
    path = checkpoint(arch)
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)
    engine = make_engine(path, max_num_batched_tokens=40, long_prefill_token_threshold=24)
    results, _ = run_engine(engine, prompts, MAX_NEW_TOKENS, ARRIVAL_STEPS)
    assert_matches(f"{arch}/chunked", results, references(path, prompts))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_prefix_cache_hits(checkpoint, arch):
    path = checkpoint(arch)
    prompts = shared_prefix_prompts(hf_model(path).config.vocab_size)
    engine = make_engine(path)
    first, _ = run_engine(engine, prompts, MAX_NEW_TOKENS, [0, 3, 6, 9])
    refs = references(path, prompts)
    assert_matches(f"{arch}/prefix-first", first, refs)
    # Later arrivals hit the shared 100-token prefix (6 full blocks) of earlier ones; prompt 2 hits 140 (8 blocks).
    assert [r.num_cached_tokens for r in first] == [0, 96, 128, 96]
    second, _ = run_engine(engine, prompts, MAX_NEW_TOKENS, [0, 0, 0, 0])
    assert all(r.num_cached_tokens >= 96 for r in second)
    assert [r.token_ids for r in second] == [r.token_ids for r in first]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_under_preemption(checkpoint, arch):
    path = checkpoint(arch)
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)
    # 40 usable blocks = 640 tokens for requests that need 843 together: some must be preempted and recomputed.
    engine = make_engine(path, num_kv_blocks=41)
    results, num_preemptions = run_engine(engine, prompts, MAX_NEW_TOKENS)
    assert num_preemptions > 0
    assert_matches(f"{arch}/preemption", results, references(path, prompts))
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 40


def test_llama3_rope_scaling_matches_transformers(checkpoint):
    path = checkpoint("llama", config_overrides=LLAMA3_ROPE)
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)
    results, _ = run_engine(make_engine(path), prompts, MAX_NEW_TOKENS, ARRIVAL_STEPS)
    assert_matches("llama3-rope/staggered", results, references(path, prompts))


def test_mistral_sliding_window_is_exercised(checkpoint):
    """Same seed, same shapes: llama and mistral tiny checkpoints hold the same weights, and differ only in
    mistral's 128-token sliding window. So the references agree inside the window and differ beyond it, and the
    mistral tests above really check the window."""
    llama, mistral = checkpoint("llama"), checkpoint("mistral")
    prompts = random_prompts(hf_model(llama).config.vocab_size, PROMPT_LENS)
    ref_llama, ref_mistral = references(llama, prompts), references(mistral, prompts)
    inside = (ref_llama[2].logprobs[0] - ref_mistral[2].logprobs[0]).abs().max().item()  # 33 tokens
    beyond = (ref_llama[5].logprobs[0] - ref_mistral[5].logprobs[0]).abs().max().item()  # 300 tokens
    assert inside < 1e-5 < 1e-2 < beyond


def test_logprobs_match_transformers_log_softmax(checkpoint):
    path = checkpoint("llama")
    model = hf_model(path)
    prompts = random_prompts(model.config.vocab_size, [5, 60, 200], seed=3)
    engine = make_engine(path, max_num_batched_tokens=64)
    results, _ = run_engine(engine, prompts, 16, prompt_logprobs=5)
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            ref = model(ids).logits[0].float().log_softmax(-1)  # [prompt + outputs, vocab]
        # Sampled tokens: position t predicts output token t.
        for step, (token, entry) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + step]
            assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
            top_values = sorted(entry.values(), reverse=True)[:5]
            assert top_values == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
        # Prompt tokens 1..P-1 given their prefixes.
        assert len(result.prompt_logprobs) == len(prompt) - 1
        for position, entry in enumerate(result.prompt_logprobs):
            target = prompt[position + 1]
            assert entry[target] == pytest.approx(ref[position, target].item(), abs=1e-4)
            assert max(entry.values()) == pytest.approx(ref[position].max().item(), abs=1e-4)


def test_seeded_sampling_is_independent_of_batch(checkpoint):
    path = checkpoint("llama")
    engine = make_engine(path)
    vocab = hf_model(path).config.vocab_size
    target = random_prompts(vocab, [20], seed=5)
    others = random_prompts(vocab, [3, 90, 40], seed=6)
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "logprobs": None}
    alone, _ = run_engine(engine, target, 24, **params)
    crowded, _ = run_engine(engine, others + target, 24, [0, 0, 1, 2], **params)
    assert crowded[-1].token_ids == alone[0].token_ids
    unseeded = {"temperature": 0.9, "top_p": 0.95, "logprobs": None}
    varied, _ = run_engine(engine, target * 4, 24, **unseeded)
    assert len({tuple(r.token_ids) for r in varied}) > 1  # unseeded draws do differ


def test_bfloat16_dense_decode_weights_stay_as_close_to_float32_as_the_packed_ones(checkpoint):
    """bfloat16 with ``dense_decode_weights``: one request's decode steps go through the compiled matrix-vector
    kernel (LM head included) where the build has it, else the packed weights. At every decode step where the
    float32 engine (which matches transformers, above) and both bfloat16 engines have produced the same tokens so
    far, the dense path's top-5 logprobs drift from float32's no more than the packed bfloat16 path's do: the two
    differ only in the order of float32 sums before the one rounding to bfloat16."""
    path = checkpoint("llama")
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)[:3]
    engines = {
        "float32": make_engine(path),
        "packed": make_engine(path, dtype="bfloat16"),
        "dense": make_engine(path, dtype="bfloat16", dense_decode_weights=True),
    }
    if compiled_gemv(torch.bfloat16) is not None:  # the kernel's path is the one taken
        model = engines["dense"].model_runner.model
        assert all(m.dense_weight is not None for m in model.modules() if isinstance(m, Linear))
    drifts: dict[str, list[float]] = {"packed": [], "dense": []}
    for prompt in prompts:  # one at a time: every decode step has one row
        results = {
            name: run_engine(engine, [prompt], MAX_NEW_TOKENS, logprobs=5)[0][0] for name, engine in engines.items()
        }
        reference = results["float32"]
        for step in range(MAX_NEW_TOKENS):  # step 0: the prefill's (its LM head row through the kernel when dense)
            if any(r.token_ids[:step] != reference.token_ids[:step] for r in results.values()):
                break
            for name in drifts:
                ours = results[name].logprobs[step]
                drifts[name] += [abs(ours[t] - v) for t, v in reference.logprobs[step].items() if t in ours]
    assert len(drifts["dense"]) >= 10, "too few decode steps agreed to compare"
    # measured: 0.143 for both on this checkpoint; a wrong weight or dropped column moves logprobs by nats
    assert max(drifts["dense"]) <= 1.25 * max(drifts["packed"]) + 0.02, (max(drifts["dense"]), max(drifts["packed"]))


def _bfloat16_kv_cache() -> object:
    """transformers' cache holding keys and values as a bfloat16 KV cache does: each rounded to bfloat16 once as it
    is stored (keys after RoPE), attention reading them back as float32, the step's own included."""
    from transformers import DynamicCache

    class BFloat16KVCache(DynamicCache):
        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            rounded = (key_states.bfloat16().float(), value_states.bfloat16().float())
            return super().update(*rounded, layer_idx, *args, **kwargs)

    return BFloat16KVCache()


def test_bfloat16_kv_cache_matches_transformers_with_its_keys_and_values_rounded(checkpoint):
    """``kv_cache_dtype="bfloat16"`` under a float32 model: transformers with every key and value rounded as the
    cache rounds them gives the same tokens and, where they agree, the same logprobs within float32 noise; without
    the rounding it does not (the check can tell the two apart). Staggered arrivals: prefill chunks over their own
    keys, decode steps through the CPU kernel's reads of the bfloat16 cache."""
    path = checkpoint("llama")
    prompts = random_prompts(hf_model(path).config.vocab_size, PROMPT_LENS)
    engine = make_engine(path, kv_cache_dtype="bfloat16")
    assert all(c.dtype == torch.bfloat16 for c in engine.model_runner.kv_caches)
    results, _ = run_engine(engine, prompts, MAX_NEW_TOKENS, ARRIVAL_STEPS, logprobs=1)
    rounded = [hf_greedy(path, p, MAX_NEW_TOKENS, make_cache=_bfloat16_kv_cache) for p in prompts]
    assert_matches("llama/bfloat16 KV cache", results, rounded)
    ours_vs_rounded, plain_vs_rounded = [], []
    for ours, ref, plain in zip(results, rounded, references(path, prompts), strict=True):
        for step, token in enumerate(ref.token_ids):
            if ours.token_ids[: step + 1] != ref.token_ids[: step + 1]:
                break
            ours_vs_rounded.append(abs(ours.logprobs[step][token] - ref.logprobs[step][token].item()))
            if plain.token_ids[: step + 1] == ref.token_ids[: step + 1]:
                plain_vs_rounded.append(abs(plain.logprobs[step][token].item() - ref.logprobs[step][token].item()))
    assert len(ours_vs_rounded) >= 20
    # measured: 4.8e-6 (float32 sums in another order) against 2.9e-4 for transformers without the rounding
    assert max(ours_vs_rounded) < 5e-5, max(ours_vs_rounded)
    assert max(plain_vs_rounded) > 10 * max(ours_vs_rounded), (max(plain_vs_rounded), max(ours_vs_rounded))


def test_bfloat16_kv_cache_prefix_hits_read_what_a_miss_computes(checkpoint):
    """With a bfloat16 KV cache, a prompt whose prefix comes from the cache (prefill over rounded cached keys)
    and the same prompt computed whole (prefill over its own keys, rounded as the cache rounds them) give the same
    tokens and logprobs, and match transformers with the rounding cache."""
    path = checkpoint("llama")
    prompts = shared_prefix_prompts(hf_model(path).config.vocab_size)
    engine = make_engine(path, kv_cache_dtype="bfloat16")
    first, _ = run_engine(engine, prompts, MAX_NEW_TOKENS, [0, 3, 6, 9], logprobs=1)
    assert [r.num_cached_tokens for r in first] == [0, 96, 128, 96]  # later arrivals hit the shared blocks
    misses, _ = run_engine(
        make_engine(path, kv_cache_dtype="bfloat16", enable_prefix_caching=False), prompts, MAX_NEW_TOKENS, logprobs=1
    )
    assert all(r.num_cached_tokens == 0 for r in misses)
    rounded = [hf_greedy(path, p, MAX_NEW_TOKENS, make_cache=_bfloat16_kv_cache) for p in prompts]
    assert_matches("llama/bfloat16 KV cache, prefix hits", first, rounded)
    for hit, miss in zip(first, misses, strict=True):
        assert hit.token_ids == miss.token_ids
        for step, token in enumerate(hit.token_ids):
            assert abs(hit.logprobs[step][token] - miss.logprobs[step][token]) < 5e-5
