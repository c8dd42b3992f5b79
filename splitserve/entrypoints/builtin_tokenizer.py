"""The builtin tokenizer: a byte-level BPE that the ``tokenizers`` library trains deterministically, offline,
from the docstrings of a fixed list of Python standard-library modules (plus a few lines of non-Latin text so
multi-byte characters get merges too). It makes a fresh clone self-sufficient: test checkpoints and the demo
model need no download.

Byte-level pre-tokenization means every string encodes (no unknown token). The same Python minor version
gives the same corpus, so the same vocabulary.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [UNK, BOS, EOS]  # ids 0, 1, 2, as Llama's
DEFAULT_VOCAB_SIZE = 8192
# A minimal Llama-2-style chat template (rendered by transformers' apply_chat_template).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)

_CORPUS_MODULES = [
    "abc",
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "types",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
]
_EXTRA_LINES = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Grüße aus Köln! Ça va très bien, merci. ¿Dónde está la biblioteca?",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Привет, мир! Γειά σου Κόσμε! שלום עולם! مرحبا بالعالم!",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ — and math: ∑ ∫ √ π ≈ 3.14159.",
]


def corpus() -> list[str]:
    """Training text: module, class and function docstrings of ``_CORPUS_MODULES``, in a fixed order."""
    texts: list[str] = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name:
                texts.append(inspect.getdoc(obj) or "")
    texts.extend(_EXTRA_LINES * 20)
    return [t for t in texts if t]


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE. Adds BOS at the start of every encoded sequence, as Llama's tokenizer does."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_builtin_tokenizer(out_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to ``out_dir``.

    Returns the vocabulary size (special tokens included).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}, indent=2) + "\n"
    )
    return tokenizer.get_vocab_size()
