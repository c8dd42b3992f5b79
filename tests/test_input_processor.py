"""The InputProcessor without an engine: max_tokens against max_model_len, text prompts refused by their length
before tokenizing, chat text parts joined, priorities the wire can carry."""

from __future__ import annotations

import re
from typing import Any

import pytest

from frontend_svc import SamplingParams, ValidationError
from frontend_svc.chars_per_token import MAX_CANONICAL_DECOMPOSITION, max_chars_per_token
from frontend_svc.engine_types import EngineInfo
from frontend_svc.input_processor import InputProcessor, RequestOptions
from frontend_svc.sampling_params import sampling_params_with_defaults
from tests.conftest import real_or_builtin, shared_tokenizer


def engine_info(max_model_len: int, vocab_size: int = 32000) -> EngineInfo:
    return EngineInfo(
        model="m",
        max_model_len=max_model_len,
        block_size=16,
        num_kv_blocks=1000,
        kv_cache_tokens=16000,
        vocab_size=vocab_size,
        eos_token_ids=(2,),
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_logprobs=20,
        dtype="float32",
    )


class CountingTokenizer:
    """A tokenizer that counts the calls that tokenize (``__call__``, ``encode``); everything else is the
    wrapped tokenizer's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def load(path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def llama2_tokenizer():
    return load(real_or_builtin("llama2"))


@pytest.fixture(scope="module")
def real_llama2_tokenizer():
    """Llama 2's own tokenizer, for tests that rely on its facts (tokens of at most 16 characters), else skip."""
    return load(shared_tokenizer("llama2"))


# --- max_tokens within max_model_len (issue 12, item 5) ---


def test_prompt_plus_max_tokens_over_max_model_len_is_refused_naming_max_tokens(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    prompt = list(range(10, 18))  # 8 ids
    with pytest.raises(ValidationError) as info:
        processor.process_inputs("r", prompt, SamplingParams(max_tokens=61))
    assert info.value.field == "max_tokens"
    message = str(info.value)
    assert message.startswith("max_tokens: 61 is too large")
    assert "maximum context length is 64 tokens" in message
    assert "69 were requested (8 in the prompt, 61 in the completion)" in message
    assert "at most 56 fit" in message
    # The way out it names is true: None takes the room left. (It used to say "max_tokens unset or None: up to
    # max_model_len", while unset is 16 both here and over gRPC.)
    assert message.endswith("(max_tokens=None, max_tokens_unlimited over gRPC, takes all the room left)")
    with pytest.raises(ValidationError, match="max_tokens: 16 is too large") as unset:
        processor.process_inputs("r", list(range(10, 60)), SamplingParams())
    assert "at most 14 fit" in str(unset.value)
    assert (
        processor.process_inputs("r", list(range(10, 60)), SamplingParams(max_tokens=None))[
            0
        ].sampling_params.max_tokens
        == 14
    )
    # Right at the limit: 8 + 56 = 64.
    request, _ = processor.process_inputs("r", prompt, SamplingParams(max_tokens=56))
    assert request.sampling_params.max_tokens == 56


def test_unset_max_tokens_takes_the_room_left_and_a_model_default_is_capped_to_it(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    prompt = list(range(10, 18))

    def resolved(params: SamplingParams) -> int:
        return processor.process_inputs("r", prompt, params)[0].sampling_params.max_tokens

    assert resolved(SamplingParams(max_tokens=None)) == 56
    # The model's default (generation config max_new_tokens) is a cap, never a refusal (vLLM's get_max_tokens).
    assert resolved(sampling_params_with_defaults({}, {"max_tokens": 100})) == 56
    assert resolved(sampling_params_with_defaults({}, {"max_tokens": 10})) == 10
    # A value the caller chose is checked, whatever the model's default.
    with pytest.raises(ValidationError, match="max_tokens: 57 is too large"):
        processor.process_inputs("r", prompt, sampling_params_with_defaults({"max_tokens": 57}, {"max_tokens": 10}))
    # The refusal says where the derived max_tokens came from: the model's default, or the room left.
    with pytest.raises(
        ValidationError, match=r"min_tokens: 20 is above the derived max_tokens 10 \(the model's default\)$"
    ):
        processor.process_inputs("r", prompt, sampling_params_with_defaults({"min_tokens": 20}, {"max_tokens": 10}))
    with pytest.raises(
        ValidationError,
        match=r"min_tokens: 57 is above the derived max_tokens 56 \(the room left within max_model_len\)$",
    ):
        processor.process_inputs("r", prompt, sampling_params_with_defaults({"min_tokens": 57}, {"max_tokens": 100}))


# --- text prompts refused by length before tokenizing (issue 12, item 12(b)) ---


@pytest.mark.parametrize(("name", "longest"), [("llama2", 16), ("gpt2", 128)])
def test_max_chars_per_token_is_the_longest_vocabulary_string(name, longest):
    # llama2: "▁Einzelnachweise" and sixteen "▁"; gpt2: a 128-byte run of mis-encoded "Ã‚" pairs.
    assert max_chars_per_token(load(shared_tokenizer(name))) == longest


@pytest.mark.parametrize("name", ["llama2", "gpt2", "builtin"])
def test_no_text_has_more_characters_than_its_tokens_can_cover(name):
    tokenizer = load(shared_tokenizer(name))
    bound = max_chars_per_token(tokenizer)
    assert bound is not None
    longest = max(tokenizer.get_vocab(), key=len)
    texts = [
        " " * 5000,
        "-" * 5000,
        "\n" * 3000,
        longest * 200,
        "e\u0301" * 1000,  # combining marks
        "\u1100\u1161\u11a8" * 500,  # Hangul jamo
        "日本語のテキスト" * 300,
        "🙂👍🏽" * 500,
        "the " * 2000,
        "<s></s><unk>" * 200,
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(text) <= bound * len(ids), (text[:20], len(text), len(ids))


def test_a_text_longer_than_any_prompt_that_fits_is_refused_without_tokenizing(real_llama2_tokenizer):
    """Llama 2's longest token has 16 characters, so 63 of them (1008) are within the byte bound (63 * 32)."""
    llama2_tokenizer = real_llama2_tokenizer
    tokenizer = CountingTokenizer(llama2_tokenizer)
    processor = InputProcessor(tokenizer, engine_info(max_model_len=64))
    per_token = max(len(token) for token in llama2_tokenizer.get_vocab())
    assert processor.max_prompt_chars == 63 * per_token  # 63 prompt tokens leave one for the output
    with pytest.raises(ValidationError) as info:
        processor.process_inputs("r", "x" * (63 * per_token + 1), SamplingParams())
    assert info.value.field == "prompt"
    assert f"has {63 * per_token + 1} characters" in str(info.value)
    assert tokenizer.calls == 0
    # The 6 MB prompt of the issue: refused the same way.
    with pytest.raises(ValidationError, match="prompt: the prompt has 6000000 characters"):
        processor.process_inputs("r", "x" * 6_000_000, SamplingParams())
    assert tokenizer.calls == 0
    # Right at the bound the text goes the normal way: tokenized, then refused by its token count.
    with pytest.raises(ValidationError, match="prompt: has .* tokens, which leaves no room"):
        processor.process_inputs("r", "x" * (63 * per_token), SamplingParams())
    assert tokenizer.calls == 1
    request, text = processor.process_inputs("r", "Hello world", SamplingParams())
    assert tokenizer.calls == 2 and request.prompt_token_ids == llama2_tokenizer("Hello world").input_ids


def test_a_rendered_conversation_too_long_is_refused_without_tokenizing(llama2_tokenizer):
    tokenizer = CountingTokenizer(llama2_tokenizer)
    processor = InputProcessor(tokenizer, engine_info(max_model_len=64))
    limit = processor.max_prompt_chars
    with pytest.raises(ValidationError, match="prompt: the rendered conversation has"):
        processor.render_chat([{"role": "user", "content": "y" * limit}])
    assert tokenizer.calls == 0
    processor.render_chat([{"role": "user", "content": "y" * 10}])
    assert tokenizer.calls == 1


def _wordpiece() -> Any:
    """A tokenizer with no sound bound on characters per token (WordPiece: one [UNK] for a whole unknown word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_a_text_over_max_model_len_times_32_bytes_is_refused_without_tokenizing_whatever_the_tokenizer():
    """Without a sound bound (WordPiece), a text of more than 63 * 32 UTF-8 bytes is still refused before
    tokenizing, so that no text the receive limit lets in costs gigabytes to tokenize; at the bound it is tokenized.
    Non-ASCII text counts its bytes, not its characters."""
    tokenizer = CountingTokenizer(_wordpiece())
    processor = InputProcessor(tokenizer, engine_info(max_model_len=64))
    assert processor.max_prompt_chars is None and processor.max_prompt_bytes == 63 * 32
    with pytest.raises(ValidationError) as info:
        processor.process_inputs("r", "a " * 1008 + "b", SamplingParams())  # 2017 bytes
    assert info.value.field == "prompt"
    assert str(info.value) == (
        "prompt: the prompt has 2017 bytes (UTF-8), more than this server tokenizes for a prompt within "
        "max_model_len=64 (2016: 63 tokens of 32 bytes, where text averages 2 to 4 bytes per token)"
    )
    with pytest.raises(ValidationError, match="prompt: the prompt has 2019 bytes"):
        processor.process_inputs("r", "é" * 1000 + "a" * 19, SamplingParams())  # 1019 characters, 2019 bytes
    with pytest.raises(ValidationError, match="text: the text has 2017 bytes"):
        processor.check_text_length("b" * 2017, "text", "the text")
    assert tokenizer.calls == 0
    with pytest.raises(ValidationError, match="prompt: has 1008 tokens"):  # 2016 bytes: tokenized, then too long
        processor.process_inputs("r", "a " * 1008, SamplingParams())
    assert tokenizer.calls == 1


def test_a_text_within_the_character_bound_may_still_be_over_the_byte_bound(real_llama2_tokenizer):
    """Llama 2's tokens have at most 16 characters: 63 tokens hold at most 1008. 700 CJK characters are within
    that, but 2100 bytes, over 63 * 32: refused by bytes, before tokenizing."""
    tokenizer = CountingTokenizer(real_llama2_tokenizer)
    processor = InputProcessor(tokenizer, engine_info(max_model_len=64))
    assert processor.max_prompt_chars == 1008
    with pytest.raises(ValidationError, match="prompt: the prompt has 2100 bytes"):
        processor.process_inputs("r", "日" * 700, SamplingParams())
    assert tokenizer.calls == 0


def test_pipelines_that_can_drop_text_get_no_bound():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}

    def wrapped(backend: Tokenizer) -> Any:
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")

    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    assert max_chars_per_token(wrapped(wordpiece)) is None  # one [UNK] for a whole unknown word
    fused = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=True))
    assert max_chars_per_token(wrapped(fused)) is None  # a run of unknown characters is one token
    per_char = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=False))
    assert max_chars_per_token(wrapped(per_char)) == 5  # "[UNK]"
    per_char.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # drops whitespace
    assert max_chars_per_token(wrapped(per_char)) is None
    per_char.pre_tokenizer = None
    per_char.normalizer = normalizers.NFKC()
    assert max_chars_per_token(wrapped(per_char)) == 5 * MAX_CANONICAL_DECOMPOSITION
    per_char.normalizer = normalizers.Strip()
    assert max_chars_per_token(wrapped(per_char)) is None


def test_max_canonical_decomposition_is_unicodes():
    import unicodedata

    assert max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)) == MAX_CANONICAL_DECOMPOSITION


# --- chat text parts (issue 12, item 7) ---


def test_text_parts_of_a_message_are_joined_with_newlines(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]
    rendered = processor.render_chat([{"role": "user", "content": parts}])
    expected = llama2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate:\nbonjour"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered["prompt"] == expected
    assert rendered["prompt_token_ids"] == llama2_tokenizer(expected, add_special_tokens=False).input_ids


# A template that reads a variable of its own and ends an assistant turn unless continue_final_message leaves it open.
VARIABLE_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }} {% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% if not loop.last %} </turn> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %} </turn> [assistant]{% endif %}"
)


def test_chat_template_kwargs_continue_final_message_and_add_special_tokens_render_as_transformers(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    rendered = processor.render_chat(
        messages,
        add_generation_prompt=False,
        chat_template=VARIABLE_TEMPLATE,
        continue_final_message=True,
        add_special_tokens=True,
        chat_template_kwargs={"greeting": "Hello"},
    )
    expected = llama2_tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=VARIABLE_TEMPLATE, continue_final_message=True, greeting="Hello"
    )
    assert rendered["prompt"] == expected == "Hello [user] Count </turn> [assistant] one two"
    ids = llama2_tokenizer(expected).input_ids
    assert rendered["prompt_token_ids"] == ids and ids[0] == llama2_tokenizer.bos_token_id
    plain = processor.render_chat(messages, chat_template=VARIABLE_TEMPLATE)  # the defaults: no BOS added
    assert plain["prompt"] == "[user] Count </turn> [assistant] one two </turn> [assistant]"
    assert plain["prompt_token_ids"] == llama2_tokenizer(plain["prompt"], add_special_tokens=False).input_ids


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "messages", "conversation", "return_dict"])
def test_chat_template_kwargs_naming_a_rendering_argument_are_refused(llama2_tokenizer, key):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    with pytest.raises(ValidationError) as info:
        processor.render_chat(CHAT_MESSAGES, chat_template_kwargs={key: False})
    assert info.value.field == f"chat_template_kwargs.{key}"


def test_chat_template_kwargs_override_the_rendering_fields_as_vllm_s_server(llama2_tokenizer):
    """add_generation_prompt, continue_final_message, tools and documents in chat_template_kwargs win over the
    request's own (vLLM's chat server updates its rendering arguments with them)."""
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
        "{% for d in documents or [] %}<doc {{ d.title }}>{% endfor %}"
        "{% for t in tools or [] %}<tool {{ t.name }}>{% endfor %}"
    )
    overridden = processor.render_chat(
        CHAT_MESSAGES,
        True,
        template,
        chat_template_kwargs={"add_generation_prompt": False, "documents": [{"title": "a"}], "tools": [{"name": "f"}]},
    )
    assert overridden["prompt"] == "[user] hi <doc a><tool f>"
    assert processor.render_chat(CHAT_MESSAGES, True, template, documents=[{"title": "b"}])["prompt"] == (
        "[user] hi [assistant]<doc b>"
    )


CHAT_MESSAGES = [{"role": "user", "content": "hi"}]

# Templates that walk a message's content part by part, in the forms real templates use (Llama 3.1's tool
# template, Llama Guard's, Mistral's): the "openai" content format.
PARTS_TEMPLATES = [
    "{% for m in messages %}{{ m.role }}:{% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}|{% endfor %}",
    "{% for message in messages %}{{ message['role'] }}:{% for part in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{{ part['text'] }}{% endfor %}|{% endfor %}",
    "{% set first = messages[0] %}{% for m in messages[1:] %}{% endfor %}{{ first.role }}:"
    "{% for c in first.content %}{{ c.text }}{% endfor %}|",
]
PARTS_TEMPLATES.append(  # Mistral's and Gemma's opening: the loop runs over a name bound from messages
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{{ message['role'] }}:"
    "{% for c in message['content'] %}{{ c['text'] }}{% endfor %}|{% endfor %}"
)
STRING_TEMPLATES = [
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}",
    "{% for m in messages %}{% for line in m.content.split('\\n') %}{{ line }}{% endfor %}{% endfor %}",
    "{% for item in tools or [] %}{% for c in item.content %}{% endfor %}{% endfor %}{{ messages[0].content }}",
]


@pytest.mark.parametrize("template", PARTS_TEMPLATES)
def test_a_template_that_walks_the_content_gets_parts(llama2_tokenizer, template):
    from frontend_svc.chat_content_format import detect_content_format

    assert detect_content_format(template) == "openai"
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    rendered = processor.render_chat(messages, False, template)["prompt"]
    assert rendered.startswith("user:helloworld|")
    assert processor.render_chat([{"role": "user", "content": "hi"}], False, template)["prompt"].startswith("user:hi|")
    # forced to a string, the template's loop walks characters and finds no parts
    forced = processor.render_chat(messages, False, template, content_format="string")["prompt"]
    assert "hello" not in forced


@pytest.mark.parametrize("template", STRING_TEMPLATES)
def test_a_template_that_prints_the_content_gets_text(llama2_tokenizer, template):
    from frontend_svc.chat_content_format import detect_content_format

    assert detect_content_format(template) == "string"


def test_the_real_templates_content_formats():
    from transformers import AutoTokenizer

    from frontend_svc.chat_content_format import detect_content_format
    from tests.conftest import SHARED_TOKENIZERS

    for name in ("llama2", "gpt2", "qwen2", "mistral"):
        folder = SHARED_TOKENIZERS / name
        if not (folder / "tokenizer_config.json").is_file():
            continue
        template = AutoTokenizer.from_pretrained(folder).chat_template
        if isinstance(template, str):  # these print each message's content whole
            assert detect_content_format(template) == "string", name


def test_chat_messages_keep_what_vllm_keeps(llama2_tokenizer):
    """Tool-call arguments given as JSON strings reach the template as objects ({} when not one), an empty
    tool_calls and a non-string name are dropped, reasoning is given under both of vLLM's names, and text-like
    parts (input_text, output_text, refusal, plain strings) are text; a null text part is skipped."""
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    template = (
        "{% for m in messages %}[{{ m.role }}{% if m.name is defined %} {{ m.name }}{% endif %}] {{ m.content }}"
        "{% if m.reasoning_content is defined %} <r {{ m.reasoning }}/{{ m.reasoning_content }}>{% endif %}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} {{ c.function.name }}"
        "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %};{% endfor %}{% endif %}"
        "{% endfor %}"
    )

    def call(arguments: str) -> dict:
        return {"id": "c", "type": "function", "function": {"name": "get", "arguments": arguments}}

    messages = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, "b", {"type": "text", "text": None}],
            "name": 5,
        },
        {
            "role": "assistant",
            "content": [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "c"}],
            "reasoning_content": "why",
            "tool_calls": [call('{"city": "Paris"}'), call("not json"), call("[1, 2]")],
            "name": "bot",
        },
        {"role": "user", "content": "d", "tool_calls": []},
    ]
    rendered = processor.render_chat(messages, False, template)["prompt"]
    assert rendered == "[user] a\nb[assistant bot] no\nc <r why/why> get city=Paris; get; get;[user] d"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's, untouched


# --- priority ---


@pytest.mark.parametrize("priority", [True, 1.5, "1", 2**31, -(2**31) - 1])
def test_a_priority_the_wire_cannot_carry_is_refused(llama2_tokenizer, priority):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    with pytest.raises(ValidationError) as info:
        processor.process_inputs("r", [5, 6], SamplingParams(), RequestOptions(priority=priority))
    assert info.value.field == "priority"
    request, _ = processor.process_inputs("r", [5, 6], SamplingParams(), RequestOptions(priority=-(2**31)))
    assert request.priority == -(2**31)


@pytest.mark.parametrize(
    ("ids", "field"), [([5, True, 6], "prompt_token_ids[1]"), ([5, 6, 7.0], "prompt_token_ids[2]")]
)
def test_token_id_prompts_must_be_integers(llama2_tokenizer, ids, field):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=64))
    with pytest.raises(ValidationError, match=rf"^{re.escape(field)}: must be an integer token id, got "):
        processor.process_inputs("r", ids, SamplingParams())
    assert processor.process_inputs("r", [5, 6, 7], SamplingParams())[0].prompt_token_ids == [5, 6, 7]


def test_a_developer_message_is_a_system_one_for_templates_without_that_role(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    as_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert processor.render_chat(messages)["prompt"] == processor.render_chat(as_system)["prompt"]
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }}|{% endfor %}"
    assert processor.render_chat(messages, False, knows)["prompt"] == "D:be brief|hi|"


def test_a_tool_calls_value_that_is_not_a_list_is_refused_naming_it(llama2_tokenizer):
    processor = InputProcessor(llama2_tokenizer, engine_info(max_model_len=2048))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": 5}]
    with pytest.raises(ValidationError) as info:
        processor.render_chat(messages)
    assert info.value.field == "messages[1].tool_calls"
