"""Structured outputs on random-weight checkpoints: only the grammar bitmask keeps the outputs valid, so every
output is checked by an independent validator (``json`` + ``jsonschema``, ``re.fullmatch``, membership)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from core_svc.errors import InvalidRequestError
from core_svc.request import Request, RequestStatus
from core_svc.sampling_params import SamplingParams as CoreSamplingParams
from core_svc.structured_output import GrammarOutput, apply_grammar_bitmask
from frontend_svc import LLM, SamplingParams, StructuredOutputsParams, ValidationError
from tests.conftest import real_or_builtin
from tests.helpers import make_engine

# Nested objects, an enum, arrays with minItems / maxItems, string patterns, bounded integers: every value is
# bounded, so a complete document is always reachable within MAX_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["name", "age"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "kind", "owner", "tags", "ok"],
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["kind", "n", "tags"],
}
COMPACT_JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"[a-d]{2,4}-[0-9]{1,3}@(x|yz)\.com"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']
MAX_TOKENS = 120


def nested(depth: int) -> str:
    """A JSON schema text whose objects nest ``depth`` levels: {"items": {"items": ... {"type": "array"}}}."""
    return '{"items": ' * (depth - 1) + '{"type": "array"}' + "}" * (depth - 1)


DEEP_TEXT = nested(5000)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Hello"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model

    return make_test_model(
        tmp_path_factory.mktemp("so-llama"), "llama", "tiny", tokenizer=real_or_builtin("llama2"), seed=0
    )


@pytest.fixture(scope="module")
def engine(model):
    """One default engine core for the tests that need nothing else of it (each ends with it idle; a test that
    holds a compilation uses a constraint no other test compiles, since a cached grammar would not be held)."""
    return make_engine(model)


@pytest.fixture(scope="module")
def llm(model):
    with LLM(str(model), num_kv_blocks=257) as instance:
        yield instance


def eos_id(llm: LLM) -> int:
    return llm.get_tokenizer().eos_token_id


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


# --- the frontend's checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        (StructuredOutputsParams(), "structured_outputs", "exactly one of json, json_object, regex, choice, grammar"),
        (StructuredOutputsParams(json=SCHEMA, regex="a"), "structured_outputs", "got json, regex"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs", "got regex, choice"),
        ({"jsn": {}}, "structured_outputs", "unknown field(s) jsn"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json", "is not valid JSON"),
        (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json", "does not compile"),
        (StructuredOutputsParams(regex="a[b"), "structured_outputs.regex", "does not compile"),
        (StructuredOutputsParams(grammar='root ::= "a" | b'), "structured_outputs.grammar", "does not compile"),
        # Lark, which llguidance would take and xgrammar (GBNF) refuses: refused here, saying GBNF is expected.
        (StructuredOutputsParams(grammar='start: "a"'), "structured_outputs.grammar", "must be a GBNF grammar"),
        (StructuredOutputsParams(choice=["ok", ""]), "structured_outputs.choice[1]", "non-empty string"),
        (StructuredOutputsParams(json_object=False, regex="a\x00"), "structured_outputs.regex", "NUL"),
        # Deeper than json's decoder recurses (RecursionError), and just past the depth limit, as text and dict.
        (StructuredOutputsParams(json=DEEP_TEXT), "structured_outputs.json", "nests deeper than 64 levels"),
        (StructuredOutputsParams(json=json.loads(nested(65))), "structured_outputs.json", "deeper than 64"),
        # Keywords xgrammar compiles away (its grammar is the one without them): refused, with where they are.
        (
            StructuredOutputsParams(json={"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}),
            "structured_outputs.json",
            "uniqueItems (at the schema) is not enforced",
        ),
        (
            StructuredOutputsParams(json={"properties": {"xs": {"type": "array", "contains": {"const": 7}}}}),
            "structured_outputs.json",
            "contains (at properties.xs) is not enforced",
        ),
        (
            StructuredOutputsParams(json={"anyOf": [{"type": "string", "pattern": "^[a-c]+$", "minLength": 4}]}),
            "structured_outputs.json",
            "minLength / maxLength beside a pattern or format (at anyOf[0])",
        ),
        (
            StructuredOutputsParams(json={"properties": {"c": {"type": "string", "format": "color"}}}),
            "structured_outputs.json",
            "format 'color' (at properties.c)",
        ),
        (
            StructuredOutputsParams(json={"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}),
            "structured_outputs.json",
            "if (at the schema)",
        ),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(value, field, words):
    with pytest.raises(ValidationError) as info:
        SamplingParams(structured_outputs=value)
    assert info.value.field == field
    assert words in info.value.description


def test_the_frontend_checks_constraints_without_torch():
    """llguidance, not xgrammar (whose import pulls torch), compiles in the frontend: after checking a schema, a
    regex and a grammar, neither torch nor xgrammar is imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from frontend_svc import SamplingParams, StructuredOutputsParams as S\n"
        "for so in (S(json={'type': 'object'}), S(regex='[a-z]+'), S(grammar='root ::= \"a\"')):\n"
        "    SamplingParams(structured_outputs=so)\n"
        "print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_dict_of_fields_is_taken_as_vllm_takes_it():
    params = SamplingParams(structured_outputs={"regex": "[a-z]+", "disable_any_whitespace": True})
    assert params.structured_outputs == StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True)


def test_the_bitmask_masks_exactly_the_cleared_bits_of_each_requests_row():
    """Against a per-bit loop over the packed words (little-endian bits within each int32 word), with the
    bitmask's rows in another order than the logits' (the runner puts decodes first)."""
    gen = torch.Generator().manual_seed(0)
    vocab_size = 70  # three words, the last one partly used
    logits = torch.randn((4, vocab_size), generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    out = logits.clone()
    apply_grammar_bitmask(out, ["a", "b", "c", "d"], GrammarOutput(["d", "b"], bitmask))
    expected = logits.clone()
    for i, row in enumerate([3, 1]):
        for token in range(vocab_size):
            word = int(bitmask[i, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # rows without a grammar untouched


# --- generation ---------------------------------------------------------------------------------------------


def test_json_schema_outputs_parse_and_validate_greedy_and_random_n(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=COMPACT_JSON)
    random_n = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=MAX_TOKENS, structured_outputs=COMPACT_JSON)
    outputs = llm.generate(PROMPTS, [greedy, random_n, greedy, random_n], use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 8
    for completion in completions:
        document = json.loads(completion.text)
        jsonschema.validate(document, SCHEMA)
        assert completion.finish_reason == "stop"
        assert completion.token_ids[-1] == eos_id(llm)  # ended by EOS, which the grammar allowed only now
    # n children sample independently (each its own matcher): not all the same document.
    assert len({c.text for c in outputs[1].outputs}) > 1


def test_json_with_whitespace_and_json_object(llm):
    """Whitespace allowed (vLLM's default): a valid document, or max_tokens reached inside one (the random model
    may pick whitespace for ever). json_object: a JSON object. An empty-object schema, compact: exactly {}."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        ),
        SamplingParams(
            temperature=1.0,
            seed=4,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(
                json=json.dumps({"type": "object", "maxProperties": 0}), disable_any_whitespace=True
            ),
        ),
    ]
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for output, schema in zip(outputs, [SCHEMA, {"type": "object"}, {"maxProperties": 0}], strict=True):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
    assert outputs[2].outputs[0].text == "{}"


def test_an_empty_schema_is_any_json_as_a_dict_and_as_text(llm):
    """json={} and json="{}" are the same constraint (the empty schema: any JSON value)."""
    as_dict, as_text = StructuredOutputsParams(json={}), StructuredOutputsParams(json="{}")
    assert as_dict.key == as_text.key == ("json", "{}", False)
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so) for so in (as_dict, as_text)]
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            json.loads(completion.text)
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 40


def test_regex_and_choice_outputs(llm):
    regex = StructuredOutputsParams(regex=REGEX)
    choice = StructuredOutputsParams(choice=CHOICES)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
        SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=40, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=choice),
        SamplingParams(temperature=1.0, n=6, seed=2, max_tokens=40, structured_outputs=choice),
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for completion in [*outputs[0].outputs, *outputs[1].outputs]:
        assert re.fullmatch(REGEX, completion.text), completion.text
        assert completion.finish_reason == "stop"
    for completion in [*outputs[2].outputs, *outputs[3].outputs]:
        assert completion.text in CHOICES
        assert completion.finish_reason == "stop"


def test_choices_with_escapes_and_non_ascii_are_output_exactly(llm):
    """Newline, tab, quote, backslash, U+2028 and an emoji in the choices: each output is exactly one of them."""
    choices = ["a\nb", "tab\there", 'say "hi"', "back\\slash", "line\u2028sep", "ok 🙂"]
    params = SamplingParams(
        temperature=1.0, n=8, seed=9, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    completions = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs
    for completion in completions:
        assert completion.text in choices, completion.text
        assert completion.finish_reason == "stop"


def test_schemas_llguidance_does_not_implement_but_xgrammar_compiles_are_served(llm):
    """not: llguidance would refuse it as an unimplemented key; the frontend checks leniently and the core compiles
    it. Every output validates against the schema without it (docs/operations.md); a property named like a
    keyword xgrammar drops ("contains") is a property, not that keyword."""
    schemas = [
        {"type": "object", "properties": {"contains": {"enum": ["a", "b"]}}, "required": ["contains"]},
        {"type": "object", "properties": {"n": {"type": "integer", "not": {"enum": [0]}}}, "required": ["n"]},
    ]
    params = [
        SamplingParams(
            temperature=1.0,
            n=3,
            seed=6,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for schema in schemas
    ]
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for output, schema in zip(outputs, schemas, strict=True):
        for completion in output.outputs:
            if completion.finish_reason == "length":  # a long integer may run past max_tokens
                continue
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), without_keys(schema, {"not"}))


def without_keys(value: object, keys: set[str]) -> object:
    if isinstance(value, dict):
        return {k: without_keys(v, keys) for k, v in value.items() if k not in keys}
    return value


def test_grammar_output(llm):
    grammar = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [0-9] | "x"'
    params = SamplingParams(
        temperature=1.0, n=3, seed=5, max_tokens=30, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    for completion in llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs:
        assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x)){0,2}\)", completion.text), completion.text


def test_eos_is_allowed_only_where_the_output_is_complete(llm):
    """EOS made the most likely token everywhere (logit_bias +100): a constrained request then ends at the first
    token where its text is complete, and never before; an unconstrained one ends at once."""
    eos = eos_id(llm)
    bias = {eos: 100.0}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=40, logit_bias=bias, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    free = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=bias)
    with_eos, without = llm.generate(PROMPTS[:2], [constrained, free], use_tqdm=False)
    assert without.outputs[0].token_ids == [eos]
    completion = with_eos.outputs[0]
    assert completion.token_ids[-1] == eos and re.fullmatch(REGEX, completion.text)
    tokenizer = llm.get_tokenizer()
    ids = completion.token_ids[:-1]
    for end in range(len(ids)):  # no shorter token prefix was complete, or EOS would have ended it there
        assert not re.fullmatch(REGEX, tokenizer.decode(ids[:end], skip_special_tokens=True))


@pytest.fixture(scope="module")
def greedy_json(llm):
    """The greedy COMPACT_JSON completion of PROMPTS[0], which several tests compare against."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=COMPACT_JSON)
    return llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]


def test_max_tokens_inside_the_structure_is_length(llm, greedy_json):
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=COMPACT_JSON)
    completion = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)
    assert greedy_json.token_ids[:4] == completion.token_ids  # the same path, cut


def test_unconstrained_requests_in_the_batch_give_their_solo_outputs(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    solo = [llm.generate([PROMPTS[i]], p, use_tqdm=False)[0].outputs[0].token_ids for i, p in ((1, free), (3, seeded))]
    constrained = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=COMPACT_JSON)
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=10, structured_outputs={"choice": CHOICES})
    outputs = llm.generate(PROMPTS, [constrained, free, choice, seeded], use_tqdm=False)
    assert [outputs[1].outputs[0].token_ids, outputs[3].outputs[0].token_ids] == solo
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), SCHEMA)
    assert outputs[2].outputs[0].text in CHOICES


def test_stop_strings_trim_a_constrained_output(llm, greedy_json):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=COMPACT_JSON)
    full = greedy_json.text
    stop = '"owner"'
    assert stop in full
    params.stop = [stop]
    completion = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert completion.text == full[: full.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


# --- the engine core: chunked prefill, preemption, compilation off the step loop ------------------------------


def core_params(**fields: object) -> CoreSamplingParams:
    return CoreSamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **fields})  # type: ignore[arg-type]  # fields as keywords


def run_to_end(engine, requests: list[Request]) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Add ``requests``, step until all finish: token ids and finish reasons by id, and preemptions seen."""
    for request in requests:
        engine.add_request(request)
    token_ids: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    num_preemptions = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs.scheduler_stats is not None:
            num_preemptions += outputs.scheduler_stats.num_preemptions
        for output in outputs.outputs:
            token_ids.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[output.request_id] = str(output.finish_reason)
    return token_ids, reasons, num_preemptions


def decode(model, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode(token_ids, skip_special_tokens=True)


def test_chunked_prefill_and_preemption_keep_outputs_valid(model, engine):
    """Prompts in small chunks (only the chunk that samples is masked), and a KV cache too small for all: requests
    are preempted mid-structure and resume with their matchers; the outputs equal those of a roomy engine."""
    prompts = [[(7 * i + j) % 500 + 10 for j in range(40)] for i in range(4)]
    so = StructuredOutputsParams(json=SMALL_SCHEMA, disable_any_whitespace=True)

    def requests() -> list[Request]:
        return [Request(f"r{i}", p, core_params(max_tokens=60, structured_outputs=so)) for i, p in enumerate(prompts)]

    expected, _, _ = run_to_end(engine, requests())
    tight = make_engine(model, max_num_batched_tokens=16, num_kv_blocks=1 + 8, block_size=16)
    ids, reasons, num_preemptions = run_to_end(tight, requests())
    assert num_preemptions > 0
    assert ids == expected
    for request_id, token_ids in ids.items():
        assert reasons[request_id] == "stop"
        jsonschema.validate(json.loads(decode(model, token_ids)), SMALL_SCHEMA)


def test_compilation_does_not_stall_the_step_loop(model, engine, monkeypatch):
    """While a grammar compiles (held here), its request waits in WAITING_FOR_FSM and an unconstrained request
    runs to its end; released, the constrained one runs."""
    manager = engine.structured_output_manager
    release = threading.Event()
    compile_now = manager._compile_now

    def held(params):
        release.wait(30)
        return compile_now(params)

    monkeypatch.setattr(manager, "_compile_now", held)
    regex = REGEX.replace("com", "org")  # compiled by no other test on this engine: held, not cached
    constrained = Request("so", [5, 6, 7], core_params(structured_outputs=StructuredOutputsParams(regex=regex)))
    free = Request("free", [8, 9], core_params(max_tokens=5, ignore_eos=True))
    engine.add_request(constrained)
    engine.add_request(free)
    free_ids: list[int] = []
    while "free" in engine.scheduler.requests:
        free_ids += next((o.new_token_ids for o in engine.step().outputs if o.request_id == "free"), [])
        assert constrained.status == RequestStatus.WAITING_FOR_FSM and constrained.num_computed_tokens == 0
    assert len(free_ids) == 5
    release.set()
    _, reasons, _ = run_to_end(engine, [])
    assert reasons == {"so": "stop"}
    assert constrained.status == RequestStatus.FINISHED_STOPPED
    assert re.fullmatch(regex, decode(model, constrained.output_token_ids))


def test_a_constraint_xgrammar_refuses_fails_the_request_in_the_core(engine):
    """A raw client of the core (no frontend check): the request ends with INVALID_ARGUMENT and xgrammar's
    reason; another request goes on."""
    bad = Request("bad", [5, 6], core_params(structured_outputs=StructuredOutputsParams(regex="a(b")))
    good = Request("good", [5, 6], core_params(max_tokens=3, ignore_eos=True))
    errors = {}
    engine.add_request(bad)
    engine.add_request(good)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.error is not None:
                errors[output.request_id] = output.error
    assert list(errors) == ["bad"]
    assert isinstance(errors["bad"], InvalidRequestError) and errors["bad"].field == "structured_outputs.regex"
    assert good.num_output_tokens == 3


def test_min_tokens_past_the_constraints_end_is_a_conflict_and_the_refused_token_is_left_out(model, engine):
    """choice ["a"] with min_tokens=5: once "a" is out, the grammar allows only EOS, which min_tokens forbids, so
    the mask lets nothing through. The output is "a" alone (no token the grammar refused) and the request ends with
    INVALID_ARGUMENT naming min_tokens and the conflict, not an engine failure."""
    request = Request("x", [5, 6], core_params(min_tokens=5, structured_outputs=StructuredOutputsParams(choice=["a"])))
    engine.add_request(request)
    token_ids: list[int] = []
    errors = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            token_ids += output.new_token_ids
            if output.error is not None:
                errors.append(output.error)
    assert decode(model, token_ids) == "a" and request.output_token_ids == token_ids
    assert request.status == RequestStatus.FINISHED_ERROR
    assert len(errors) == 1 and isinstance(errors[0], InvalidRequestError)
    assert errors[0].field == "min_tokens"
    assert "conflicts with the structured_outputs constraint" in errors[0].description


def test_a_deeply_nested_schema_is_refused_by_the_core_as_invalid_not_internal(engine):
    """A raw client of the core: a schema deeper than json's decoder recurses, and one just past the limit, are
    INVALID_ARGUMENT naming structured_outputs.json; one at the limit is taken."""
    for i, text in enumerate([DEEP_TEXT, nested(65)]):
        params = core_params(structured_outputs=StructuredOutputsParams(json=text))
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(Request(f"deep{i}", [5, 6], params))
        assert info.value.field == "structured_outputs.json" and "deeper than 64" in info.value.description
    SamplingParams(structured_outputs=StructuredOutputsParams(json=nested(64)))  # the frontend takes it too
    engine.add_request(Request("ok", [5, 6], core_params(structured_outputs=StructuredOutputsParams(json=nested(64)))))
    assert engine.scheduler.requests["ok"].status == RequestStatus.WAITING_FOR_FSM
    engine.abort_requests(["ok"])
    engine.step()  # hands out the aborted id: the next test starts from a quiet engine


def test_the_core_refuses_two_constraints_naming_the_field(engine):
    params = core_params(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"]))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("two", [5, 6], params))
    assert info.value.field == "structured_outputs"
    # A schema keyword xgrammar would drop, sent to the core directly: refused there too, in the same words.
    unique = StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(Request("unique", [5, 6], core_params(structured_outputs=unique)))
    assert info.value.field == "structured_outputs.json" and "uniqueItems" in info.value.description


def test_grammars_are_compiled_once_per_key_and_the_cache_is_bounded(model, monkeypatch):
    from core_svc import structured_output

    engine = make_engine(model)
    manager = engine.structured_output_manager
    compiled: list[tuple[str, str, bool]] = []
    compile_now = manager._compile_now

    def counted(params):
        compiled.append(params.key)
        return compile_now(params)

    monkeypatch.setattr(manager, "_compile_now", counted)
    monkeypatch.setattr(structured_output, "MAX_CACHED_GRAMMARS", 2)
    regexes = ["a+", "a+", "b+", "c+", "a+"]  # "a+" is evicted by "b+" and "c+", then compiled again
    requests = []
    for i, regex in enumerate(regexes):
        request = Request(f"r{i}", [5, 6], core_params(structured_outputs=StructuredOutputsParams(regex=regex)))
        manager.grammar_init(request)
        assert request.structured_output is not None
        request.structured_output.future.result(timeout=30)
        requests.append(request)
    assert [key[1] for key in compiled] == ["a+", "b+", "c+", "a+"]
    # Each request has its own matcher, even on one compiled grammar.
    assert requests[0].structured_output.grammar is not requests[1].structured_output.grammar


class ScriptedGrammar:
    """Accepts the ids in ``allowed``; terminates once it accepted ``stop_id``."""

    def __init__(self, allowed: set[int], stop_id: int) -> None:
        self.allowed, self.stop_id, self.terminated = allowed, stop_id, False

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.terminated = token_id == self.stop_id
        return True

    def is_terminated(self) -> bool:
        return self.terminated


def test_scheduler_skips_requests_waiting_for_their_grammar_and_keeps_their_order():
    from concurrent.futures import Future

    from core_svc.structured_output_request import StructuredOutputRequest
    from tests.factories import make_request, make_scheduler, run_step

    scheduler = make_scheduler()
    waiting = [make_request("so-1"), make_request("so-2")]
    futures = []
    for request in waiting:
        future: Future = Future()
        request.structured_output = StructuredOutputRequest(StructuredOutputsParams(regex="a"), future)
        request.status = RequestStatus.WAITING_FOR_FSM
        futures.append(future)
        scheduler.add_request(request)
    scheduler.add_request(make_request("free"))
    scheduler_output, _ = run_step(scheduler)
    assert list(scheduler_output.num_scheduled_tokens) == ["free"]
    assert [r.request_id for r in scheduler.waiting] == ["so-1", "so-2"]
    futures[1].set_result(ScriptedGrammar({100, 7}, stop_id=7))
    scheduler_output, _ = run_step(scheduler, {"so-2": 100})
    assert list(scheduler_output.num_scheduled_tokens) == ["free", "so-2"]
    assert [r.request_id for r in scheduler.waiting] == ["so-1"]
    # The grammar accepted its stop id: finished STOP; a token it refuses: ERROR.
    futures[0].set_result(ScriptedGrammar({100}, stop_id=7))
    scheduler_output, outputs = run_step(scheduler, {"so-2": 7, "so-1": 5})
    by_id = {o.request_id: o for o in outputs.outputs}  # type: ignore[attr-defined]  # EngineCoreOutputs
    assert str(by_id["so-2"].finish_reason) == "stop"
    assert str(by_id["so-1"].finish_reason) == "error" and by_id["so-1"].new_token_ids == []  # 5 left out
    assert "conflicts with the structured_outputs constraint" in str(by_id["so-1"].error)


def test_a_core_without_the_models_tokenizer_refuses_constraints(model, tmp_path):
    """The weights without tokenizer files: the core starts; a constrained request fails with INVALID_ARGUMENT
    saying why, and so does the next one, while an unconstrained one runs."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(model / name, bare / name)
    engine = make_engine(bare)
    for i in range(2):
        engine.add_request(
            Request(f"so{i}", [5, 6], core_params(structured_outputs=StructuredOutputsParams(regex="a+")))
        )
    free = Request("free", [5, 6], core_params(max_tokens=3, ignore_eos=True))
    engine.add_request(free)
    errors = []
    while engine.has_unfinished_requests():
        errors += [o.error for o in engine.step().outputs if o.error is not None]
    assert len(errors) == 2
    for error in errors:
        assert isinstance(error, InvalidRequestError)
        assert error.field == "structured_outputs" and "tokenizer" in error.description
    assert free.num_output_tokens == 3


def test_a_reused_request_id_does_not_get_the_aborted_requests_compile_failure(model, engine, monkeypatch):
    """A request "x" (regex "a(", which does not compile) is aborted while compiling and a new valid "x" (choice)
    is added: the old failure, arriving later, must not end the new request, which gives one of its choices."""
    manager = engine.structured_output_manager
    release = threading.Event()
    compile_now = manager._compile_now

    def held(params):
        release.wait(30)
        return compile_now(params)

    monkeypatch.setattr(manager, "_compile_now", held)
    old = Request("x", [5, 6], core_params(structured_outputs=StructuredOutputsParams(regex="a(")))
    engine.add_request(old)
    engine.step()
    engine.abort_requests(["x"])
    new = Request("x", [5, 6], core_params(structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    engine.add_request(new)
    release.set()
    old_future = old.structured_output.future  # type: ignore[union-attr]  # set by grammar_init
    assert isinstance(old_future.exception(timeout=30), InvalidRequestError)
    token_ids, reasons, _ = run_to_end(engine, [])
    assert reasons == {"x": "stop"}
    assert new.status == RequestStatus.FINISHED_STOPPED
    assert decode(model, new.output_token_ids) in CHOICES
    assert manager.take_failed() == []


def test_shutdown_cancels_queued_compilations_and_fails_their_requests(model, monkeypatch):
    """Two compilations held on the pool's two threads, a third queued: shutdown cancels the queued one, whose
    request fails with UNAVAILABLE naming the shutdown (not a CancelledError, not waiting for ever); the pool takes
    no more work, and the held ones end once released."""
    from core_svc.engine_loop import EngineLoop
    from core_svc.errors import EngineUnavailableError

    engine = make_engine(model)
    manager = engine.structured_output_manager
    release = threading.Event()
    started = threading.Semaphore(0)
    compile_now = manager._compile_now

    def held(params):
        started.release()
        release.wait(30)
        return compile_now(params)

    monkeypatch.setattr(manager, "_compile_now", held)
    requests = [
        Request(f"r{i}", [5, 6], core_params(structured_outputs=StructuredOutputsParams(regex=f"{c}+")))
        for i, c in enumerate("abc")
    ]
    for request in requests:
        engine.add_request(request)
    assert started.acquire(timeout=30) and started.acquire(timeout=30)  # both threads busy: "c+" is queued
    EngineLoop(engine).stop()  # the core's stop path (never started here: the test steps the core itself)
    release.set()
    queued = requests[2].structured_output
    assert queued is not None and isinstance(queued.future.exception(timeout=30), EngineUnavailableError)
    assert manager._executor is not None and manager._executor._shutdown
    outputs = engine.step().outputs
    errors = {o.request_id: o.error for o in outputs if o.error is not None}
    assert list(errors) == ["r2"] and "shut down" in str(errors["r2"])
    for request in requests[:2]:
        assert request.structured_output is not None and request.structured_output.future.result(timeout=30)
    with pytest.raises(EngineUnavailableError):
        engine.add_request(Request("late", [5], core_params(structured_outputs=StructuredOutputsParams(regex="d+"))))


def test_the_tokenizer_info_is_built_at_startup_not_at_the_first_constrained_request(model, monkeypatch):
    """Building it holds the GIL for a while: at startup, once; a constrained request then builds nothing."""
    import xgrammar as xgr

    builds: list[int] = []
    from_huggingface = xgr.TokenizerInfo.from_huggingface

    def counted(*args, **kwargs):
        builds.append(1)
        return from_huggingface(*args, **kwargs)

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", staticmethod(counted))
    engine = make_engine(model)
    assert len(builds) == 1
    request = Request("so", [5, 6], core_params(structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    _, reasons, _ = run_to_end(engine, [request])
    assert reasons == {"so": "stop"} and decode(model, request.output_token_ids) in CHOICES
    assert len(builds) == 1


def test_steps_while_every_request_waits_for_its_grammar_wait_and_emit_nothing_new(engine, monkeypatch):
    """A compilation held on an event: the first empty step reports the new load (1 waiting), the next ones return
    no outputs and no stats (nothing changed). A compilation that ends between the scheduling and the wait is not
    missed: with the wait made 30 s long, that step returns at once, and the next one runs the request."""
    import time

    from core_svc import engine_core

    manager = engine.structured_output_manager
    release = threading.Event()
    compile_now = manager._compile_now

    def held(params):
        release.wait(30)
        return compile_now(params)

    monkeypatch.setattr(manager, "_compile_now", held)
    monkeypatch.setattr(engine_core, "GRAMMAR_WAIT_S", 0.001)
    regex = REGEX.replace("com", "net")  # compiled by no other test on this engine: held, not cached
    engine.add_request(Request("so", [5, 6], core_params(structured_outputs=StructuredOutputsParams(regex=regex))))
    emitted = [engine.step() for _ in range(20)]
    assert emitted[0].scheduler_stats is not None and emitted[0].scheduler_stats.num_waiting_reqs == 1
    assert [(o.outputs, o.scheduler_stats, o.finished_requests) for o in emitted[1:]] == [([], None, set())] * 19

    monkeypatch.setattr(engine_core, "GRAMMAR_WAIT_S", 30.0)
    schedule = engine.scheduler.schedule
    num_done = manager.num_compilations_done

    def schedule_then_compile():  # the compilation ends after this step scheduled nothing, before it waits
        scheduler_output = schedule()
        release.set()
        deadline = time.monotonic() + 30
        while manager.num_compilations_done == num_done and time.monotonic() < deadline:
            time.sleep(0.001)
        return scheduler_output

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_then_compile)
    start_s = time.monotonic()
    assert engine.step().outputs == []
    assert time.monotonic() - start_s < 10  # not the 30 s wait: the ended compilation was seen
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    assert engine.step().scheduler_stats.num_running_reqs == 1  # type: ignore[union-attr]  # a step that ran
    run_to_end(engine, [])
