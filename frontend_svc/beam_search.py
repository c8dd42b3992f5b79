"""Beam search over the engine, as vLLM's ``LLM.beam_search`` (``vllm/beam_search.py``,
``vllm/entrypoints/llm.py``).

Each step sends every live beam to the engine as a prompt (its tokens so far) for one token with the top
``2 * beam_width`` logprobs (transformers' beam search also keeps twice the width of candidates, so that ``beam_width``
survive those that end), extends each beam by each candidate, and keeps the ``beam_width`` best of every prompt by
``get_beam_search_score``. A candidate that is the tokenizer's EOS (unless ``ignore_eos``) ends its beam. The prefix
cache makes each step a one-token prefill of the beam's new tokens (the shared prefix is already cached). The
engine's logprobs are the model's own (before temperature), so ``temperature`` only changes which token each step
samples beside the top candidates (0: none beyond them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from frontend_svc.engine_types import LoRARequest
from frontend_svc.errors import ValidationError
from frontend_svc.input_processor import PromptType, TokensPrompt
from frontend_svc.outputs import Logprob
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from frontend_svc.async_llm import AsyncLLM
    from frontend_svc.engine_types import EngineInfo
    from frontend_svc.input_processor import InputProcessor
    from frontend_svc.llm_engine import LLMEngine
    from frontend_svc.outputs import RequestOutput

# ``LLM.generate``'s signature, as the search calls it: (prompts, sampling params, use_tqdm, lora_request=...)
Generate = Callable[..., "list[RequestOutput]"]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.

    Raises:
        ValidationError: beam_width or max_tokens below 1, a negative or non-finite temperature, a non-finite
            length_penalty.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0  # the score's exponent of the sequence length (``get_beam_search_score``)

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValidationError("beam_width", f"must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValidationError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValidationError("temperature", f"must be non-negative and finite, got {self.temperature}")
        if not -float("inf") < self.length_penalty < float("inf"):
            raise ValidationError("length_penalty", f"must be finite, got {self.length_penalty}")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's, then the generated ones), each generated position's candidates with
    their logprobs, and the sum of the chosen tokens' logprobs. ``text`` is set on the returned beams: the
    tokenizer's decode of all ``tokens``, special tokens included (vLLM's). ``finish_reason``: "stop" for a beam
    that ended with EOS (its ``stop_reason`` the EOS id), "length" for one that reached max_tokens or
    max_model_len."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the prompt's processed images (``InputProcessor.process_multimodal``), sent with every step
    mm_features: list[Any] | None = None
    num_prompt_tokens: int = 0  # where the generated tokens start in ``tokens``

    def generated(self, eos_token_id: int | None, include_stop_str_in_output: bool = False) -> list[int]:
        """The generated tokens, a final EOS left out unless ``include_stop_str_in_output`` (the text of vLLM's
        OpenAI server)."""
        tokens = self.tokens[self.num_prompt_tokens :]
        if tokens and self.finish_reason == "stop" and tokens[-1] == eos_token_id and not include_stop_str_in_output:
            return tokens[:-1]
        return tokens


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """A beam's score: its cumulative logprob over its length (prompt included, a final EOS not counted) to the
    power ``length_penalty`` (vLLM's ``get_beam_search_score``, after transformers' ``BeamHypotheses``)."""
    length = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cumulative_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """The search of a group of prompts, one step at a time: ``step_prompts`` gives the prompts to send (each live
    beam's tokens, for one token and ``step_params``' logprobs), ``advance`` takes their outputs in that order, and
    ``outputs`` ranks what ended once no beam is live or ``max_tokens`` steps have run. Drivers: ``beam_search``
    (``LLM.generate``), ``beam_search_async`` (``AsyncLLM.generate``).

    Raises:
        ValidationError: from the constructor, ``2 * beam_width`` above the engine's max_logprobs.
    """

    def __init__(
        self, params: BeamSearchParams, initial: list[BeamSearchSequence], info: EngineInfo, tokenizer: Any
    ) -> None:
        if 0 <= info.max_logprobs < 2 * params.beam_width:  # -1: no cap
            raise ValidationError(
                "beam_width",
                f"needs 2 x beam_width = {2 * params.beam_width} logprobs per step, more than the engine's "
                f"max_logprobs ({info.max_logprobs}); at most {info.max_logprobs // 2}",
            )
        self.params = params
        self.max_model_len = info.max_model_len
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self.live: list[list[BeamSearchSequence]] = [[beam] for beam in initial]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in initial]
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width)

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def step_prompts(self) -> list[BeamSearchSequence]:
        """The live beams to extend, in order (empty: the search is over); a beam with no room left within
        max_model_len ends by length first."""
        for beams, ended in zip(self.live, self.done, strict=True):
            ended.extend(_ended(beam, "length") for beam in beams if len(beam.tokens) >= self.max_model_len)
            beams[:] = [beam for beam in beams if len(beam.tokens) < self.max_model_len]
        return [beam for beams in self.live for beam in beams]

    def advance(self, results: Sequence[RequestOutput]) -> None:
        """Each live beam extended by each candidate of its output (``results`` in ``step_prompts``' order); EOS
        (unless ignore_eos) ends a beam; each prompt keeps its beam_width best."""
        candidates = iter(results)
        for i, beams in enumerate(self.live):
            extended: list[BeamSearchSequence] = []
            for beam in beams:
                completion = next(candidates).outputs[0]
                top = completion.logprobs[0] if completion.logprobs else {}
                for token_id, logprob in top.items():
                    child = BeamSearchSequence(
                        tokens=[*beam.tokens, token_id],
                        logprobs=[*beam.logprobs, top],
                        lora_request=beam.lora_request,
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                        mm_features=beam.mm_features,
                        num_prompt_tokens=beam.num_prompt_tokens,
                    )
                    if token_id == self.eos_token_id and not self.params.ignore_eos:
                        self.done[i].append(_ended(child, "stop", token_id))
                    else:
                        extended.append(child)
            extended.sort(key=self.score, reverse=True)
            self.live[i] = extended[: self.params.beam_width]

    def outputs(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """Per prompt, the beam_width best of the ended and live beams, best first, each with its text."""
        outputs = []
        for beams, ended in zip(self.live, self.done, strict=True):
            ended.extend(_ended(beam, "length") for beam in beams)
            best = sorted(ended, key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs


def initial_beams(
    processor: InputProcessor, prompts: Sequence[PromptType], lora_requests: Sequence[LoRARequest | None]
) -> list[BeamSearchSequence]:
    """Each prompt as a beam of its tokens (text tokenized as ``generate`` tokenizes it; images processed once).

    Raises:
        ValidationError: as ``InputProcessor.tokenize`` and ``process_multimodal``; a prompt the model cannot take
            (``InputProcessor.check_prompt``: empty, no room for a token, ids outside the vocabulary), as
            ``generate`` refuses it.
    """
    initial: list[BeamSearchSequence] = []
    for prompt, lora in zip(prompts, lora_requests, strict=True):
        processed = processor.process_multimodal(prompt)
        _, token_ids = processor.tokenize(processed)
        processor.check_prompt(token_ids)
        fields: dict[str, Any] = dict(processed) if isinstance(processed, dict) else {}
        features: list[Any] | None = fields.get("mm_features")
        initial.append(
            BeamSearchSequence(
                tokens=list(token_ids), lora_request=lora, mm_features=features, num_prompt_tokens=len(token_ids)
            )
        )
    return initial


def beam_search(
    generate: Generate,
    engine: LLMEngine,
    prompts: Sequence[PromptType],
    params: BeamSearchParams,
    lora_requests: Sequence[LoRARequest | None],
    use_tqdm: bool | Callable[..., Any] = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """``LLM.beam_search`` (``generate`` its ``generate``, ``engine`` its ``llm_engine``, an adapter or None per
    prompt): one ``BeamSearchOutput`` per prompt, in prompt order.

    Raises:
        ValidationError: a bad prompt (as ``LLM.generate``), ``concurrency_limit`` below 1, ``2 * beam_width``
            above the engine's max_logprobs.
        EngineDeadError, ...: as ``LLM.generate``.
    """
    from tqdm.auto import tqdm

    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValidationError("concurrency_limit", f"must be at least 1, got {concurrency_limit}")
    tokenizer = engine.get_tokenizer()
    initial = initial_beams(engine.input_processor, prompts, lora_requests)
    limit = concurrency_limit or max(len(initial), 1)
    outputs: list[BeamSearchOutput] = []
    for start in range(0, len(initial), limit):
        search = BeamSearch(params, initial[start : start + limit], engine.engine_info, tokenizer)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        # the bar counts steps: an upper bound, the search ends early once every beam has ended
        for _ in make_bar(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm):
            batch = search.step_prompts()
            if not batch:
                break
            results = generate(
                [_step_prompt(beam) for beam in batch],
                search.step_params,
                use_tqdm=False,
                lora_request=[beam.lora_request for beam in batch],
            )
            search.advance(results)
        outputs.extend(search.outputs(tokenizer))
    return outputs


async def beam_search_async(
    engine: AsyncLLM,
    prompt: PromptType,
    params: BeamSearchParams,
    request_id: str,
    lora_request: LoRARequest | None = None,
    trace_headers: dict[str, str] | None = None,
) -> BeamSearchOutput:
    """One prompt's beam search over ``AsyncLLM.generate`` (the HTTP API's ``use_beam_search``): each step's
    beams run concurrently, as requests ``{request_id}-{step}-{beam}``; cancelling aborts them.

    Raises:
        ValidationError: a bad prompt, ``2 * beam_width`` above the engine's max_logprobs.
        EngineDeadError, ...: as ``AsyncLLM.generate``.
    """
    (initial,) = initial_beams(engine.input_processor, [prompt], [lora_request])
    search = BeamSearch(params, [initial], engine.engine_info, engine.tokenizer)
    params_final = search.step_params.clone()
    params_final.output_kind = RequestOutputKind.FINAL_ONLY

    async def last_output(beam: BeamSearchSequence, step: int, index: int) -> RequestOutput:
        result: RequestOutput | None = None
        async for output in engine.generate(
            _step_prompt(beam),
            params_final,
            f"{request_id}-{step}-{index}",
            trace_headers=trace_headers,
            lora_request=beam.lora_request,
        ):
            result = output
        if result is None:
            raise RuntimeError("a beam search step ended without an output")
        return result

    for step in range(params.max_tokens):
        batch = search.step_prompts()
        if not batch:
            break
        search.advance(await asyncio.gather(*(last_output(beam, step, i) for i, beam in enumerate(batch))))
    (output,) = search.outputs(engine.tokenizer)
    return output


def _step_prompt(beam: BeamSearchSequence) -> TokensPrompt:
    prompt = TokensPrompt(prompt_token_ids=beam.tokens)
    if beam.mm_features:
        prompt["mm_features"] = beam.mm_features
    return prompt


def _ended(beam: BeamSearchSequence, finish_reason: str, stop_reason: int | None = None) -> BeamSearchSequence:
    beam.finish_reason = finish_reason
    beam.stop_reason = stop_reason
    return beam
