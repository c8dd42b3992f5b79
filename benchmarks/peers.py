"""The CPU engines users pick instead of splitserve, on the benchmark's own checkpoint: CTranslate2 and llama.cpp
(through llama-cpp-python). Both come with the optional extra ``bench`` (``pip install -e '.[bench]'``); a peer
whose package is missing is skipped with the reason (``missing_reason``).

Each is converted once from the same Hugging Face checkpoint into the benchmark's cache folder
(``$SPLITSERVE_CACHE_DIR/bench-peers/<checkpoint>-<format>``):
- CTranslate2: its own converter for Transformers models (``ctranslate2.converters.TransformersConverter``), in
  float32 and int8 (weights int8, activations float32);
- llama.cpp: a GGUF file written with the ``gguf`` package's ``GGUFWriter`` for the Llama architecture
  (``write_llama_gguf``), f32, f16 (2-D weights in float16, norms in float32, as llama.cpp's own converter) and
  q8_0 (2-D weights in llama.cpp's 8-bit blocks, quantized by ``gguf.quants``; llama.cpp quantizes the
  activations to 8 bits per block of 32 for those matmuls).

Every peer decodes greedily, ``output_len`` tokens per request, EOS suppressed, from the same prompt token ids.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.base import envs

logger = logging.getLogger(__name__)

PEERS = ("ctranslate2", "llama.cpp")
# Each peer's packages (import names) and its precisions: CTranslate2 compute types, GGUF file types.
PEER_MODULES = {"ctranslate2": ("ctranslate2",), "llama.cpp": ("llama_cpp", "gguf")}
PEER_PRECISIONS = {"ctranslate2": ("float32", "int8"), "llama.cpp": ("f32", "f16", "q8_0")}
INSTALL_HINT = "pip install -e '.[bench]'"
# GGUF file type -> gguf.LlamaFileType member (the file's general.file_type)
GGUF_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}


def missing_reason(peer: str) -> str | None:
    """Why ``peer`` cannot run here (a package not installed), or None when it can.

    Raises:
        ValueError: an unknown peer.
    """
    if peer not in PEER_MODULES:
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    missing = [m for m in PEER_MODULES[peer] if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    packages = {"llama_cpp": "llama-cpp-python"}
    return f"{', '.join(packages.get(m, m) for m in missing)} not installed ({INSTALL_HINT})"


def peer_cache_dir(model: Path, kind: str) -> Path:
    """Where ``model`` converted to ``kind`` (``ct2-float32``, ``gguf-f16``, ...) is kept."""
    return envs.cache_dir() / "bench-peers" / f"{model.resolve().name}-{kind}"


def _fresh(marker: Path, model: Path) -> bool:
    """The conversion beside ``marker`` was made from ``model``'s current weights (their size and mtime)."""
    return marker.is_file() and json.loads(marker.read_text()) == _weights_stamp(model)


def _weights_stamp(model: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(model.glob("*.safetensors"))}


def convert_ctranslate2(model: Path, quantization: str) -> Path:
    """``model`` in CTranslate2's format (``quantization``: float32, int8), converted on first use."""
    import ctranslate2

    out = peer_cache_dir(model, f"ct2-{quantization}")
    marker = out / "splitserve_source.json"
    if not _fresh(marker, model):
        logger.info("converting %s to CTranslate2 %s in %s", model, quantization, out)
        converter = ctranslate2.converters.TransformersConverter(str(model), low_cpu_mem_usage=True)
        converter.convert(str(out), quantization=quantization, force=True)
        marker.write_text(json.dumps(_weights_stamp(model)))
    return out


def permute_for_ggml_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """A q or k projection ``[num_heads * head_size, hidden]`` from Hugging Face's rotate-half RoPE layout (each
    head's first half pairs with its second half) to GGML's adjacent pairs, as llama.cpp's converter does
    (``LlamaModel.permute``): within each head, rows ``0, h/2, 1, h/2 + 1, ...``."""
    head = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model: Path, out: Path, file_type: str) -> Path:
    """Write ``model`` (a LlamaForCausalLM folder: config.json, safetensors, tokenizer.json) as a GGUF file for
    llama.cpp's ``llama`` architecture; ``file_type``: f32, f16 (2-D weights in float16, 1-D in float32) or
    q8_0 (2-D weights quantized by ``gguf.quants.quantize`` to Q8_0: blocks of 32 int8 with a float16 scale; a
    weight whose rows are not a multiple of 32 stays f16, as llama.cpp's converter falls back).

    Raises:
        ValueError: a file type other than f32 / f16 / q8_0, a config that is not Llama's, or a tensor GGUF has no
            name for.
    """
    import gguf
    from safetensors.numpy import load_file

    if file_type not in GGUF_FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(GGUF_FILE_TYPES)}, got {file_type!r}")
    config = json.loads((model / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"{model}: GGUF conversion here is for LlamaForCausalLM, not {config.get('architectures')}")
    num_heads, num_kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or 0
    num_kv_heads = num_kv_heads or num_heads
    num_layers = config["num_hidden_layers"]
    head_size = config.get("head_dim") or config["hidden_size"] // num_heads
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(model.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_key_length(head_size)
    writer.add_value_length(head_size)
    writer.add_rope_dimension_count(head_size)
    rope = config.get("rope_parameters") or {}  # transformers 5; older configs have rope_theta at the top
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(getattr(gguf.LlamaFileType, GGUF_FILE_TYPES[file_type]))
    _add_vocab(writer, model, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(model.glob("*.safetensors")):
        tensors |= load_file(path)
    for name, tensor in tensors.items():
        data = tensor.astype(np.float32)
        if name.endswith("q_proj.weight"):
            data = permute_for_ggml_rope(data, num_heads)
        elif name.endswith("k_proj.weight"):
            data = permute_for_ggml_rope(data, num_kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{model}: no GGUF name for tensor {name}")
        if file_type == "q8_0" and data.ndim == 2:
            try:
                quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            except gguf.quants.QuantError:  # rows not a multiple of the block size: f16, as llama.cpp's converter
                writer.add_tensor(gguf_name, data.astype(np.float16))
                continue
            writer.add_tensor(gguf_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if file_type != "f32" and data.ndim == 2:
            data = data.astype(np.float16)
        writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_vocab(writer: Any, model: Path, config: dict[str, Any]) -> None:
    """The tokenizer as llama.cpp's SentencePiece vocabulary (``LlamaHfVocab`` reads tokenizer.json), padded with
    unused tokens to the model's vocabulary size; the benchmark feeds token ids, so llama.cpp never tokenizes."""
    import gguf

    vocab = gguf.LlamaHfVocab(model)
    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(token_type)
    for i in range(len(tokens), config["vocab_size"]):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model, n_vocab=len(tokens))
    special.add_to_gguf(writer)


def convert_gguf(model: Path, file_type: str) -> Path:
    """``model`` as a GGUF file of ``file_type`` (f32, f16, q8_0), written on first use."""
    folder = peer_cache_dir(model, f"gguf-{file_type}")
    path = folder / "model.gguf"
    marker = folder / "splitserve_source.json"
    if not _fresh(marker, model):
        logger.info("writing %s as GGUF %s to %s", model, file_type, path)
        folder.mkdir(parents=True, exist_ok=True)
        write_llama_gguf(model, path, file_type)
        marker.write_text(json.dumps(_weights_stamp(model)))
    return path


@dataclass
class PeerEngine:
    """One peer in one precision, loaded: ``generate_batch`` for throughput, ``stream`` for one request."""

    peer: str
    precision: str
    handle: Any  # ctranslate2.Generator or llama_cpp.Llama
    eos_token_id: int | None
    token_strings: list[str]  # CTranslate2 takes tokens as strings: id -> its vocabulary string
    note: str | None = None  # how it runs other than by default, and why (the reports print it)

    @property
    def label(self) -> str:
        return f"{self.peer} {self.precision}"

    def generate_batch(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        """Greedy ``output_len`` tokens for each prompt, all at once: CTranslate2 in one ``generate_batch`` call;
        llama.cpp one sequence per prompt in one context (``llama_cpp_batch``), as llama-server's parallel slots."""
        if self.peer == "ctranslate2":
            results = self.handle.generate_batch(
                [self._strings(p) for p in prompts],
                max_length=output_len,
                min_length=output_len,
                sampling_topk=1,
                beam_size=1,
                include_prompt_in_result=False,
                suppress_sequences=self._suppress(),
            )
            return [list(r.sequences_ids[0]) for r in results]
        return llama_cpp_batch(self.handle, prompts, output_len)

    def stream(self, prompt: list[int], output_len: int) -> Iterator[tuple[int, float]]:
        """Each greedy token of one request and ``time.perf_counter()`` when it came, ``output_len`` of them."""
        if self.peer == "ctranslate2":
            steps = self.handle.generate_tokens(
                self._strings(prompt),
                max_length=output_len,
                sampling_topk=1,
                suppress_sequences=self._suppress(),
            )
            for step in steps:
                yield step.token_id, time.perf_counter()
            return
        llm = self.handle
        llm.reset()
        count = 0
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            yield token, time.perf_counter()
            count += 1
            if count == output_len:
                return

    def _strings(self, ids: list[int]) -> list[str]:
        return [self.token_strings[i] for i in ids]

    def _suppress(self) -> list[list[str]] | None:
        return None if self.eos_token_id is None else [[self.token_strings[self.eos_token_id]]]


def load_peer(model: Path, peer: str, precision: str, num_threads: int, max_context: int) -> PeerEngine:
    """``peer`` (ctranslate2, llama.cpp) in ``precision`` (``PEER_PRECISIONS``) on ``num_threads`` threads, from
    ``model`` converted on first use; llama.cpp's context holds ``max_context`` tokens.

    Raises:
        ValueError: an unknown peer or precision.
        RuntimeError: the peer's packages are not installed (``missing_reason``).
    """
    if precision not in PEER_PRECISIONS.get(peer, ()):
        raise ValueError(f"{peer!r} runs in {PEER_PRECISIONS.get(peer)}, not {precision!r}")
    reason = missing_reason(peer)
    if reason is not None:
        raise RuntimeError(f"{peer}: {reason}")
    from transformers import AutoTokenizer

    config = json.loads((model / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_id = eos[0] if isinstance(eos, list) else eos
    if peer == "ctranslate2":
        import ctranslate2

        tokenizer = AutoTokenizer.from_pretrained(model)
        strings = [str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
        path = convert_ctranslate2(model, precision)
        handle = ctranslate2.Generator(
            str(path), device="cpu", compute_type=precision, intra_threads=num_threads, inter_threads=1
        )
        return PeerEngine(peer, precision, handle, eos_id, strings)
    import llama_cpp

    path = convert_gguf(model, precision)
    note = None
    failure = llama_cpp_extra_buffers_failure(path, num_threads)
    if failure is not None:
        note = f"extra buffer types off (with them llama.cpp {failure} at its first decode on this machine)"
        logger.warning("llama.cpp %s: %s", precision, note)
    with _llama_cpp_model_params(use_extra_bufts=failure is None):
        handle = llama_cpp.Llama(
            str(path),
            n_ctx=max_context,
            n_batch=512,
            n_threads=num_threads,
            n_threads_batch=num_threads,
            n_gpu_layers=0,
            verbose=False,
            logits_all=False,
        )
    return PeerEngine(peer, precision, handle, eos_id, [], note)


_PROBE_TIMEOUT_S = 300
_EXTRA_BUFFERS_FAILURES: dict[tuple[str, int], str | None] = {}


def llama_cpp_extra_buffers_failure(path: Path, num_threads: int) -> str | None:
    """How a llama.cpp decode of ``path`` with its extra buffer types (its default) failed in a child process, or
    None when it ran; checked once per file and thread count.

    llama-cpp-python 0.3.36 built on this project's AMX machine died with SIGILL (at ``tilezero``, in
    ``ggml_backend_amx_mul_mat``) at the first q8_0 decode there; f32 and f16 files use no extra buffer type on
    x86. Without them, q8_0 runs llama.cpp's AVX-512 / AVX2 dot products, what it runs on CPUs without AMX.
    """
    key = (str(path), num_threads)
    if key not in _EXTRA_BUFFERS_FAILURES:
        probe = [sys.executable, "-m", "benchmarks.peers", str(path), str(num_threads)]
        failure = None
        try:
            result = subprocess.run(probe, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            failure = f"did not finish a 4-token decode in {_PROBE_TIMEOUT_S} s"
        else:
            if result.returncode < 0:
                try:
                    failure = f"died with {signal.Signals(-result.returncode).name}"
                except ValueError:
                    failure = f"died with signal {-result.returncode}"
            elif result.returncode > 0:
                last = result.stderr.strip().splitlines()[-1:]
                failure = f"exited with {result.returncode}" + (f": {last[0]}" if last else "")
        _EXTRA_BUFFERS_FAILURES[key] = failure
    return _EXTRA_BUFFERS_FAILURES[key]


@contextlib.contextmanager
def _llama_cpp_model_params(use_extra_bufts: bool) -> Iterator[None]:
    """llama-cpp-python's ``Llama`` takes no ``use_extra_bufts``; it starts from ``llama_model_default_params()``,
    which this replaces while a model loads."""
    import llama_cpp.llama_cpp as capi

    default = capi.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = use_extra_bufts
        return p

    capi.llama_model_default_params = params
    try:
        yield
    finally:
        capi.llama_model_default_params = default


def llama_cpp_batch(
    llm: Any, prompts: list[list[int]], output_len: int, max_batch_tokens: int = 2048
) -> list[list[int]]:
    """Greedy ``output_len`` tokens for every prompt at once on llama.cpp, through its C API (llama-cpp-python's
    ``Llama`` decodes one sequence): a context of its own on ``llm``'s model with one sequence id per prompt in a
    unified KV cache sized for them all; prompts prefilled up to ``max_batch_tokens`` tokens per ``llama_decode``
    (logits of each prompt's last token only), then one decode call per step with one token of every sequence,
    as llama-server's continuous batching does with one slot per request.

    Raises:
        RuntimeError: llama.cpp could not make the context or a decode call failed.
    """
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    num_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sum(len(p) + output_len for p in prompts) + 16
    params.n_batch = params.n_ubatch = max(max_batch_tokens, len(prompts))
    params.n_seq_max = len(prompts)
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = llm.context_params.n_threads
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    if ctx is None:
        raise RuntimeError(f"llama.cpp could not make a context of {params.n_ctx} tokens for {len(prompts)} sequences")
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    outputs: list[list[int]] = [[] for _ in prompts]

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (sequence, position, token, wants logits) rows; appends each wanted argmax."""
        for i, (seq, pos, token, wants) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(wants)
        batch.n_tokens = len(rows)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for i, (seq, _, _, wants) in enumerate(rows):
            if wants:
                logits = llama_cpp.llama_get_logits_ith(ctx, i)
                row = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(num_vocab,))
                outputs[seq].append(int(row.argmax()))

    try:
        pending: list[tuple[int, int, int, bool]] = []
        for seq, prompt in enumerate(prompts):
            rows = [(seq, pos, token, pos == len(prompt) - 1) for pos, token in enumerate(prompt)]
            if pending and len(pending) + len(rows) > params.n_batch:
                decode(pending)
                pending = []
            pending += rows  # a prompt longer than a batch is split across decode calls
            while len(pending) > params.n_batch:
                decode(pending[: params.n_batch])
                pending = pending[params.n_batch :]
        if pending:
            decode(pending)
        for step in range(1, output_len):
            decode([(seq, len(p) + step - 1, outputs[seq][-1], True) for seq, p in enumerate(prompts)])
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return outputs


def _decode_a_few(path: Path, num_threads: int) -> None:
    """4 greedy tokens from ``path`` on llama.cpp with its extra buffer types (``llama_cpp_extra_buffers_failure``'s
    child process)."""
    import llama_cpp

    with _llama_cpp_model_params(use_extra_bufts=True):
        llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=num_threads, n_threads_batch=num_threads, verbose=False)
    for i, _ in enumerate(llm.generate([1, 2, 3], top_k=1, temp=0.0)):
        if i == 3:
            return


if __name__ == "__main__":
    _decode_a_few(Path(sys.argv[1]), int(sys.argv[2]))
