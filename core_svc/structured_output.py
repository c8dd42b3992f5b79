"""Structured outputs in the core with xgrammar (vLLM ``vllm/v1/structured_output/``: ``StructuredOutputManager``
and its xgrammar backend).

Each constrained request's constraint is compiled by xgrammar's ``GrammarCompiler`` on a thread pool, never on
the engine loop's thread: the request waits in ``WAITING_FOR_FSM`` (the scheduler skips it) until its grammar is
ready, while the other requests keep stepping. Compiled grammars are cached by (kind, spec), so n > 1 children
and repeated schemas compile once; each request then gets its own ``GrammarMatcher``. Each step the manager fills
one bitmask row per constrained request that samples (``grammar_bitmask``); the model runner sets the logits of
the tokens a row forbids to -inf before sampling (``apply_grammar_bitmask``). EOS is allowed only
where the grammar is complete (the stop tokens of the tokenizer info are the model's EOS ids).

The tokenizer info is built once, at core startup (``warm_up``), from the checkpoint's tokenizer files
(transformers ``AutoTokenizer``), as vLLM's core loads the tokenizer for structured outputs. A preempted
request keeps its matcher: preemption by recompute keeps its output tokens, which the matcher has accepted.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core_svc.errors import EngineUnavailableError, InvalidRequestError
from core_svc.outputs import SchedulerOutput
from core_svc.request import Request, RequestStatus
from core_svc.structured_output_request import Grammar, StructuredOutputRequest
from splitserve.base.structured_outputs import FIELD, StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported at warm-up (when installed), not with this module: a core starts without it
    import xgrammar as xgr

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512  # compiled grammars kept for reuse

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ", re.MULTILINE)  # the C++ logger's time and source line


@dataclass
class GrammarOutput:
    """The step's grammar bitmask (vLLM's ``GrammarOutput``)."""

    request_ids: list[str]  # row i of bitmask is request_ids[i]'s
    bitmask: torch.Tensor  # [len(request_ids), ceil(vocab_size / 32)] int32; bit j of a row: token j allowed


def apply_grammar_bitmask(logits: torch.Tensor, row_request_ids: list[str], grammar_output: GrammarOutput) -> None:
    """Set to -inf, in place, the logits each constrained row's grammar forbids (vLLM's ``apply_grammar_bitmask``,
    with xgrammar's ``apply_token_bitmask_inplace``: its C++ loop on CPU, its kernel on CUDA).

    Args:
        logits: [num_rows, vocab_size] float32, on the device.
        row_request_ids: [num_rows] the request of each logits row (the runner's order: decodes first).
        grammar_output: the bitmask rows, in ``grammar_output.request_ids``' order.
    """
    import xgrammar as xgr

    row_of = {request_id: i for i, request_id in enumerate(row_request_ids)}
    rows = [row_of[request_id] for request_id in grammar_output.request_ids]
    bitmask = torch.full((logits.shape[0], grammar_output.bitmask.shape[1]), -1, dtype=torch.int32)  # all allowed
    bitmask[rows] = grammar_output.bitmask
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


class XgrammarGrammar:
    """One request's ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles constraints off the engine loop and fills the step's bitmask.

    Args:
        model_path: the checkpoint folder, whose tokenizer files give the tokenizer info.
        vocab_size: the model's logits width (may exceed the tokenizer's; extra ids are never allowed).
        eos_token_ids: the model's EOS ids: the tokens that end a complete output.
        max_workers: compilation threads.
    """

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: list[int], max_workers: int = 2) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._executor: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._compiler_error: InvalidRequestError | None = None  # the tokenizer could not be loaded
        # key -> compilation, least recently used first; at most MAX_CACHED_GRAMMARS (a server sees any number of
        # distinct schemas; a matcher holds its own reference to its grammar, so eviction frees only the cache's)
        self._compiled: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._ready = threading.Condition()  # notified when any compilation ends
        self.num_compilations_done = 0  # compilations ended (matcher made or failed), under _ready
        self._failed: list[tuple[Request, BaseException]] = []  # requests whose constraint did not compile
        self._failed_lock = threading.Lock()
        self._is_shut_down = False

    def grammar_init(self, request: Request) -> None:
        """Start compiling ``request``'s constraint and put it in WAITING_FOR_FSM (a cached grammar is ready at
        once: the request then waits no step)."""
        params = request.sampling_params.structured_outputs if request.sampling_params is not None else None
        if params is None:
            return
        compiled = self._compile(params)
        grammar: Future[Grammar] = Future()

        def make_matcher(done: Future[xgr.CompiledGrammar]) -> None:
            import xgrammar as xgr

            if done.cancelled():  # the pool was shut down before this compilation started
                error: BaseException | None = EngineUnavailableError(
                    "the engine core shut down before this request's structured_outputs constraint was compiled"
                )
            else:
                error = done.exception()
            if error is not None:
                with self._failed_lock:  # before the future: whoever sees it failed finds the failure queued
                    self._failed.append((request, error))
                grammar.set_exception(error)
            else:
                grammar.set_result(XgrammarGrammar(xgr.GrammarMatcher(done.result())))
            with self._ready:
                self.num_compilations_done += 1
                self._ready.notify_all()

        compiled.add_done_callback(make_matcher)
        request.structured_output = StructuredOutputRequest(params, grammar)
        request.status = RequestStatus.WAITING_FOR_FSM

    def shutdown(self) -> None:
        """Stop the compile pool: compilations not started are cancelled (their requests fail with
        ``EngineUnavailableError`` at the next ``take_failed``); running ones end on their own (xgrammar cannot
        be interrupted), on threads that do not hold up the interpreter's exit for long."""
        self._is_shut_down = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def take_failed(self) -> list[tuple[Request, BaseException]]:
        """The requests whose compilation failed since the last call, with the error (``InvalidRequestError``)."""
        with self._failed_lock:
            failed, self._failed = self._failed, []
        return failed

    def forget_failures(self, requests: list[Request]) -> None:
        """Drop the failures of ``requests`` (aborted: nobody is left to fail)."""
        gone = {id(request) for request in requests}
        with self._failed_lock:
            self._failed = [(request, error) for request, error in self._failed if id(request) not in gone]

    def wait_for_grammar(self, num_seen: int, timeout_s: float) -> bool:
        """Block until more than ``num_seen`` compilations have ended (``num_compilations_done``, read before
        the step scheduled: one that ended since is not missed) or ``timeout_s`` passes. An engine loop whose
        requests all wait for grammars waits here instead of spinning. Returns whether one ended."""
        with self._ready:
            return self._ready.wait_for(lambda: self.num_compilations_done > num_seen, timeout_s)

    def grammar_bitmask(self, requests: dict[str, Request], scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """One bitmask row per constrained request that samples this step (its known tokens all computed after
        the step, so chunked-prefill chunks get none), from its matcher's state; None when there is none."""
        rows: list[tuple[str, XgrammarGrammar]] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests[request_id]
            so = request.structured_output
            if so is None or request.num_computed_tokens < request.num_tokens:
                continue
            grammar = so.grammar
            if not isinstance(grammar, XgrammarGrammar):
                raise TypeError(f"request {request_id} has a {type(grammar).__name__}, not an xgrammar matcher")
            rows.append((request_id, grammar))
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (_, grammar) in enumerate(rows):
            grammar.fill_bitmask(bitmask, i)
        return GrammarOutput([request_id for request_id, _ in rows], bitmask)

    def _compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        key = params.key
        future = self._compiled.get(key)
        if future is None or (future.done() and (future.cancelled() or future.exception() is not None)):
            if self._is_shut_down:
                raise EngineUnavailableError("the engine core has shut down")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="grammar-compile")
            future = self._executor.submit(self._compile_now, params)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return future

    def _compile_now(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile on a pool thread (xgrammar releases the GIL while it compiles).

        Raises:
            InvalidRequestError: the constraint does not compile, with xgrammar's reason.
        """
        compiler = self._get_compiler()
        kind, spec, _ = params.key
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                # Any JSON object (vLLM's json_object is "a JSON object"; xgrammar's builtin JSON grammar would
                # also allow an array or a scalar at the top).
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace, strict_mode=False
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_as_grammar(params.choice or []))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse and compile errors
            reason = _LOG_PREFIX.sub("", str(e)).strip()  # "[10:18:32] /project/cpp/regex_converter.cc:94: ..."
            raise InvalidRequestError(f"{FIELD}.{kind}", f"does not compile: {reason}") from None

    def warm_up(self) -> None:
        """Build the tokenizer info now, at core startup, when xgrammar is installed: it holds the GIL for a
        while (loading the tokenizer, then xgrammar's vocabulary pass), which at the first constrained request
        would stall every running stream. A checkpoint without tokenizer files starts all the same: its
        constrained requests are refused (``_get_compiler``)."""
        if importlib.util.find_spec("xgrammar") is None:
            return
        try:
            self._get_compiler()
        except InvalidRequestError as e:
            logger.info("structured outputs: off until requested: %s", e.description)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        """The compiler, with the tokenizer info built on first use (``warm_up``: at startup).

        Raises:
            InvalidRequestError: the checkpoint's tokenizer cannot be loaded (vLLM refuses structured outputs
                without a tokenizer too).
        """
        with self._compiler_lock:
            if self._compiler_error is not None:
                raise self._compiler_error
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                start_s = time.perf_counter()
                try:
                    tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                except (OSError, ValueError) as e:  # no tokenizer files beside the weights
                    self._compiler_error = InvalidRequestError(
                        FIELD, f"needs the model's tokenizer, which this core cannot load from {self.model_path}: {e}"
                    )
                    raise self._compiler_error from None
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_workers)
                logger.info(
                    "structured outputs: xgrammar tokenizer info built in %.2f s (%s, %d tokens)",
                    time.perf_counter() - start_s,
                    info.vocab_type.name,
                    info.vocab_size,
                )
            return self._compiler


def choice_as_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is ``choices`` (vLLM's ``choice_as_grammar``)."""
    # Each literal as a JSON string: xgrammar's EBNF string literals take JSON's escapes (\n, \t, \", \\, \uXXXX).
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
