"""Sampler: distributions (chi-square against hand-computed probabilities), processors, logprobs, seeds."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from core_svc import sampler as sampler_module
from core_svc.input_batch import CachedRequestState, build_sampling_metadata
from core_svc.sampler import Sampler, argmax
from core_svc.sampling_params import SamplingParams
from tests.helpers import needs_cpu_kernels

LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]
VOCAB = len(LOGITS)
NUM_DRAWS = 40000


def state(params: SamplingParams, request_id: str = "r", prompt=(0,), outputs=(), seed_generator=True):
    s = CachedRequestState(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        generator=torch.Generator().manual_seed(params.seed) if params.seed is not None and seed_generator else None,
        block_ids=[],
        num_computed_tokens=0,
    )
    s.token_ids.extend(outputs)
    return s


def draw(params: SamplingParams, logits=LOGITS, num=NUM_DRAWS) -> np.ndarray:
    """Counts per token over ``num`` rows of the same logits, sampled in one batch."""
    states = [state(params, str(i)) for i in range(num)]
    metadata = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    batch = torch.tensor([logits] * num, dtype=torch.float32)
    tokens = Sampler(torch.Generator().manual_seed(1234))(batch, metadata).sampled_token_ids
    return np.bincount(tokens.numpy(), minlength=VOCAB)


def softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - max(x))
    return e / e.sum()


def expected_probs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The target distribution, by hand: temperature, min-p, top-k, top-p in vLLM's order."""
    probs = softmax(np.asarray(LOGITS) / temperature)
    keep = np.ones(VOCAB, dtype=bool)
    if min_p:
        keep &= probs >= min_p * probs.max()
    order = np.argsort(-probs)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = np.where(keep, probs, 0.0)
        p = p / p.sum()
        cumulative = 0.0
        for i in order:
            if not keep[i]:
                continue
            if cumulative >= top_p:
                keep[i] = False
            cumulative += p[i]
    p = np.where(keep, probs, 0.0)
    return p / p.sum()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.8},
        {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
        {"temperature": 1.0, "min_p": 0.2},
    ],
)
def test_random_sampling_matches_reference_distribution(kwargs):
    counts = draw(SamplingParams(**kwargs))
    probs = expected_probs(**kwargs)
    assert counts[probs == 0].sum() == 0, "a token outside the allowed set was sampled"
    support = probs > 0
    _, p_value = chisquare(counts[support], NUM_DRAWS * probs[support])
    assert p_value > 1e-4, (counts, NUM_DRAWS * probs)


def test_expected_probs_by_hand():
    # top_p=0.8 keeps four tokens: 0.370 + 0.224 + 0.136 = 0.73 < 0.8, and the fourth (0.083) crosses 0.8
    p = expected_probs(top_p=0.8)
    assert (p > 0).tolist() == [True, True, True, True, False, False, False, False]
    assert expected_probs(top_k=2)[2:].sum() == 0


def test_greedy_is_argmax_after_processors():
    logits = torch.tensor([LOGITS], dtype=torch.float32)
    sampler = Sampler()
    cases = [
        (SamplingParams(temperature=0.0), 0),
        (SamplingParams(temperature=0.0, logit_bias={6: 10.0}), 6),  # -1 + 10 = 9 > 2
        (SamplingParams(temperature=0.0, allowed_token_ids=[3, 5]), 3),
        (SamplingParams(temperature=0.0, logit_bias={1: 1000.0}), 1),
        # Added as given, as vLLM's processor adds them: 2 + 100 < -3 + 150 (clamped to 100, token 0 would win)
        (SamplingParams(temperature=0.0, logit_bias={0: 100.0, 7: 150.0}), 7),
        (SamplingParams(temperature=0.0, logit_bias={0: -float("inf")}), 1),  # -inf bans the token
    ]
    for params, expected in cases:
        metadata = build_sampling_metadata([state(params)], VOCAB, torch.device("cpu"))
        assert sampler(logits, metadata).sampled_token_ids.item() == expected, params


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], eos_token_id=0)
    early = build_sampling_metadata([state(params, outputs=[7])], VOCAB, torch.device("cpu"))
    assert Sampler()(logits, early).sampled_token_ids.item() == 2  # eos 0 and stop 1 masked
    reached = build_sampling_metadata([state(params, outputs=[7, 7])], VOCAB, torch.device("cpu"))
    assert Sampler()(logits, reached).sampled_token_ids.item() == 0
    # With ignore_eos, EOS is masked until min_tokens all the same (vLLM's all_stop_token_ids always hold it), then
    # an ordinary token.
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, eos_token_id=0, ignore_eos=True)
    metadata = build_sampling_metadata([state(ignoring, outputs=[7])], VOCAB, torch.device("cpu"))
    assert Sampler()(logits, metadata).sampled_token_ids.item() == 1
    metadata = build_sampling_metadata([state(ignoring, outputs=[7, 7])], VOCAB, torch.device("cpu"))
    assert Sampler()(logits, metadata).sampled_token_ids.item() == 0
    # The model's further EOS ids (its generation config's), which ignore_eos leaves out of the stop ids, are
    # masked too (vLLM's all_stop_token_ids): with EOS ids 0 and 1, token 2.
    more = SamplingParams(temperature=0.0, min_tokens=2, eos_token_id=0, ignore_eos=True, model_eos_token_ids=(0, 1))
    metadata = build_sampling_metadata([state(more, outputs=[7])], VOCAB, torch.device("cpu"))
    assert Sampler()(logits, metadata).sampled_token_ids.item() == 2


def test_bad_words_ban_a_sequence_s_last_token_after_its_prefix():
    """By hand: [0] is banned always; [1, 2] bans 2 right after 1 in the output, [3, 4, 5] bans 5 after 3, 4 (the
    prompt does not count: vLLM's output ids)."""
    logits = torch.tensor([[6.0, 4.0, 5.0, 0.0, 0.0, 5.5, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[0], [1, 2], [3, 4, 5]])

    def sampled(outputs, prompt=(7,)) -> int:
        metadata = build_sampling_metadata([state(params, prompt=prompt, outputs=outputs)], VOCAB, torch.device("cpu"))
        return int(Sampler()(logits, metadata).sampled_token_ids.item())

    assert sampled([]) == 5  # 0 banned
    assert sampled([3, 4]) == 2  # 0 and 5 banned
    assert sampled([4]) == 5  # [3, 4] not complete
    assert sampled([1]) == 5  # 0 and 2 banned
    assert sampled([], prompt=(3, 4)) == 5  # a prefix in the prompt bans nothing
    assert state(params).is_plain_greedy is False  # the sampler runs for it


def test_only_plain_greedy_rows_skip_the_sampler():
    """``samples_by_argmax`` (the model runner then takes the argmax without the sampler) holds exactly for
    greedy rows whose logits nothing else reads or changes; each other case would make the sampler's token or
    output differ from the raw argmax."""
    greedy = SamplingParams(temperature=0.0)
    assert state(greedy).samples_by_argmax
    assert state(SamplingParams(temperature=0.0, min_tokens=2, eos_token_id=0), outputs=[7, 7]).samples_by_argmax
    others = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, logit_bias={6: 10.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 5]),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
    ]
    for params in others:
        assert not state(params).samples_by_argmax, params
    # min_tokens masks stop ids until reached: one output of two is not enough
    assert not state(SamplingParams(temperature=0.0, min_tokens=2, eos_token_id=0), outputs=[7]).samples_by_argmax


def test_penalties_hand_worked():
    # prompt has token 0; outputs are [1, 1, 3]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s = state(params, prompt=[0], outputs=[1, 1, 3])
    metadata = build_sampling_metadata([s], VOCAB, torch.device("cpu"))
    from core_svc.sampler import apply_logits_processors

    out = apply_logits_processors(torch.tensor([LOGITS]), metadata)[0].tolist()
    expected = list(LOGITS)
    expected[0] = 2.0 / 2.0  # in prompt: positive logit divided
    expected[1] = 1.5 / 2.0 - 0.5 * 2 - 0.25  # twice in output
    expected[3] = 0.5 / 2.0 - 0.5 * 1 - 0.25
    assert out == pytest.approx(expected, abs=1e-6)


def test_row_processors_touch_only_their_own_rows():
    """allowed_token_ids and penalties of one row leave the other rows' logits as they are."""
    from core_svc.sampler import apply_logits_processors

    limited = state(SamplingParams(temperature=0.0, allowed_token_ids=[3, 5]), "limited")
    penalized = state(SamplingParams(temperature=0.0, presence_penalty=1.0), "penalized", prompt=[0], outputs=[2, 2])
    plain = state(SamplingParams(temperature=0.0), "plain", prompt=[0], outputs=[2])
    metadata = build_sampling_metadata([plain, limited, penalized], VOCAB, torch.device("cpu"))
    out = apply_logits_processors(torch.tensor([LOGITS] * 3), metadata).tolist()
    assert out[0] == pytest.approx(LOGITS)
    assert [i for i, x in enumerate(out[1]) if x != float("-inf")] == [3, 5]
    expected = list(LOGITS)
    expected[2] -= 1.0  # presence: once, however often it occurred
    assert out[2] == pytest.approx(expected)


def test_logprobs_are_raw_with_rank_and_top_k():
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 10.0})
    metadata = build_sampling_metadata([state(params)], VOCAB, torch.device("cpu"))
    result = Sampler()(torch.tensor([LOGITS]), metadata)
    assert result.sampled_token_ids.item() == 5
    raw = np.log(softmax(LOGITS))  # before the bias: logprobs describe the model, not the processors
    assert result.logprobs is not None
    lp = result.logprobs.tolists()
    assert lp.logprob_token_ids == [[5, 0, 1, 2]]
    assert lp.logprobs[0] == pytest.approx([raw[5], raw[0], raw[1], raw[2]], abs=1e-6)
    assert lp.ranks == [6]


def test_seeded_rows_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.tensor([LOGITS], dtype=torch.float32)

    def sequence(batch_extra: int, engine_seed: int) -> list[int]:
        seeded = state(params, "seeded")
        sampler = Sampler(torch.Generator().manual_seed(engine_seed))
        tokens = []
        for _ in range(20):
            others = [state(SamplingParams(temperature=1.0), f"o{i}") for i in range(batch_extra)]
            states = others + [seeded]
            metadata = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
            out = sampler(logits.expand(len(states), -1).contiguous(), metadata)
            tokens.append(out.sampled_token_ids[-1].item())
        return tokens

    alone = sequence(0, engine_seed=0)
    assert sequence(5, engine_seed=1) == alone
    assert sequence(2, engine_seed=2) == alone
    assert len(set(alone)) > 1  # really random, not a constant


def test_whole_vocabulary_logprobs():
    params = SamplingParams(temperature=0.0, logprobs=-1)
    metadata = build_sampling_metadata([state(params)], VOCAB, torch.device("cpu"))
    logprobs = Sampler()(torch.tensor([LOGITS]), metadata).logprobs
    assert logprobs is not None
    lp = logprobs.tolists()
    assert len(lp.logprob_token_ids[0]) == 1 + VOCAB
    assert math.fsum(math.exp(v) for v in lp.logprobs[0][1:]) == pytest.approx(1.0, abs=1e-5)


def test_rank_counts_ties_like_vllm():
    from core_svc.sampler import gather_logprobs

    logprobs = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    lists = gather_logprobs(logprobs, torch.tensor([2]), 1, [1]).tolists()
    assert lists.ranks == [4]  # tokens at least as likely as token 2: itself, 0, 1 and 3
    assert lists.logprob_token_ids == [[2, 0]]


@pytest.mark.parametrize("route", ["torch", needs_cpu_kernels("kernel")])
@pytest.mark.parametrize("vocab_size", [5, 100, 256, 8192, 32000, 50257])
def test_argmax_equals_torch_argmax_with_ties(monkeypatch, route, vocab_size):
    """Both routes of ``argmax``: torch's two stages, and the compiled ``argmax_rows`` once the kernels are loaded
    (vectors of 16 on AVX-512, of 8 on AVX2, and a scalar tail)."""
    if route == "torch":
        monkeypatch.setattr(sampler_module, "loaded_ops", lambda: None)
    else:
        assert sampler_module.loaded_ops() is not None
    gen = torch.Generator().manual_seed(vocab_size)
    wide = torch.randn(9, vocab_size + 3, generator=gen)
    x = wide[:, :vocab_size]  # rows at a stride, as a slice of a wider buffer
    x[1] = 1.0  # all tied: the first index
    x[2, 7 % vocab_size] = x[2, vocab_size - 1] = 9.0  # tie between the first chunk and the (short) last one
    x[3, vocab_size - 1] = 9.0  # maximum in the last column
    x[4, 200 % vocab_size] = x[4, 130 % vocab_size] = 9.0  # two maxima, possibly in one chunk
    x[5, vocab_size - 1] = float("nan")  # NaN counts as the maximum, in the tail chunk too
    x[6, 3] = float("nan")  # the first of two NaNs, beside an infinity
    x[6, vocab_size - 1] = float("nan")
    x[6, 1] = float("inf")
    x[7] = float("-inf")  # every value -inf: the first index
    x[8, vocab_size // 2] = float("inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
