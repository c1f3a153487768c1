"""gpuagent.engine.tokenizer: the byte-level tokenizer and loading tokenizer.json."""

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from gpuagent.engine.tokenizer import (
    BYTE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerLoadError,
    load_tokenizer,
    save_byte_tokenizer,
)

TEXTS = [
    "",
    "hello, world",
    "  leading and trailing spaces \n\n\t",
    "안녕하세요. 모델 배포를 승인해 주세요.",
    "def f(x):\n    return {'키': x ** 2}  # 주석\r\n",
    "mixed 한국어 and emoji 🙂🚀, combining é, CJK 漢字, NUL \x00 and DEL \x7f",
]


@pytest.fixture
def byte_tokenizer(tmp_path):
    save_byte_tokenizer(tmp_path)
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_it_round_trips_any_utf8_text_one_token_per_byte(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text)

    assert ids == list(text.encode("utf-8"))
    assert byte_tokenizer.decode(ids) == text


def test_it_maps_special_token_strings_to_their_own_ids(byte_tokenizer):
    ids = byte_tokenizer.encode("<|user|>\nhi<|eos|>")

    assert ids == [260, 10, ord("h"), ord("i"), 257]
    assert byte_tokenizer.decode(ids, skip_special_tokens=True) == "\nhi"


def test_it_exposes_vocab_and_special_ids(byte_tokenizer):
    assert byte_tokenizer.vocab_size == BYTE_VOCAB_SIZE == 256 + len(SPECIAL_TOKENS)
    assert byte_tokenizer.bos_token_id == 256
    assert byte_tokenizer.eos_token_id == 257
    assert byte_tokenizer.decode([byte_tokenizer.eos_token_id]) == "<|eos|>"


def test_it_renders_the_chat_template_with_a_generation_prompt(byte_tokenizer):
    messages = [
        {"role": "system", "content": "짧게 답하세요."},
        {"role": "user", "content": "Hi"},
    ]

    prompt = byte_tokenizer.apply_chat_template(messages)

    assert prompt == (
        "<|bos|><|system|>\n짧게 답하세요.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\n"
    )
    ids = byte_tokenizer.encode(prompt)
    assert ids[:2] == [256, 259] and ids[-2:] == [261, 10]


def test_it_renders_without_generation_prompt_when_asked(byte_tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    prompt = byte_tokenizer.apply_chat_template(messages, add_generation_prompt=False)

    assert prompt == "<|bos|><|user|>\na<|eos|>\n<|assistant|>\nb<|eos|>\n"


def test_it_loads_a_tokenizer_without_tokenizer_config(tmp_path):
    save_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()

    tokenizer = load_tokenizer(tmp_path)

    assert tokenizer.decode(tokenizer.encode("ok")) == "ok"
    assert tokenizer.eos_token_id is None
    with pytest.raises(ValueError, match="chat_template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_it_renders_chat_templates_sandboxed(tmp_path):
    save_byte_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)

    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_it_loads_only_from_the_given_file_bytes(tmp_path):
    save_byte_tokenizer(tmp_path / "real")
    files = {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()}

    tokenizer = load_tokenizer(tmp_path / "elsewhere", files=files)

    assert tokenizer.encode("가") == list("가".encode())
    assert tokenizer.eos_token_id == 257
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "elsewhere", files={})


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("tokenizer.json", b'{"version": "1.0", "model": {', "not a valid tokenizer"),
        ("tokenizer.json", b"\xff\xfe", "not a valid tokenizer"),
        ("tokenizer_config.json", b"{not json", "not JSON"),
        ("tokenizer_config.json", b"[1, 2]", "not a JSON object"),
        ("tokenizer_config.json", b'\xef\xbb\xbf{"model_max_length": 8}', "BOM"),
    ],
    ids=["truncated-tokenizer", "not-utf8", "config-not-json", "config-array", "bom"],
)
def test_it_names_a_broken_tokenizer_file(tmp_path, name, content, reason):
    save_byte_tokenizer(tmp_path / "real")
    files = {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()}
    files[name] = content

    with pytest.raises(TokenizerLoadError, match=reason):
        load_tokenizer(tmp_path / "real", files=files)


def detokenize_step_by_step(tokenizer, ids):
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.text(ids[:k]) for k in range(1, len(ids) + 1)]


def full_decodes(tokenizer, ids):
    return [
        tokenizer.decode(ids[:k], skip_special_tokens=True)
        for k in range(1, len(ids) + 1)
    ]


@pytest.mark.parametrize("text", TEXTS[1:])
def test_it_detokenizes_incrementally_exactly_as_a_full_decode(byte_tokenizer, text):
    # Multi-byte characters arrive one byte per token: cut-off ones show as U+FFFD
    # until complete, as in a full decode; special tokens are skipped.
    ids = byte_tokenizer.encode(text)
    ids = ids[:3] + [byte_tokenizer.eos_token_id] + ids[3:]

    assert detokenize_step_by_step(byte_tokenizer, ids) == full_decodes(
        byte_tokenizer, ids
    )


def test_it_detokenizes_invalid_utf8_incrementally_as_a_full_decode(byte_tokenizer):
    rng = random.Random(0)
    ids = [
        rng.choice([0x41, 0xE3, 0x81, 0x82, 0xF0, 0x9F, 0xC3, 0xA9]) for _ in range(300)
    ]

    assert detokenize_step_by_step(byte_tokenizer, ids) == full_decodes(
        byte_tokenizer, ids
    )


def test_it_detokenizes_sentencepiece_style_leading_spaces_like_a_full_decode():
    # Metaspace decoders drop the first token's leading space: the context tokens
    # kept before the unsettled tail make the increments match a full decode.
    words = ["▁Hello", "▁world", ",", "▁again", "▁and", "!", "<unk>"]
    inner = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace()
    inner.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(inner)
    ids = [0, 1, 2, 3, 4, 3, 5, 0, 1]

    steps = detokenize_step_by_step(tokenizer, ids)

    assert steps == full_decodes(tokenizer, ids)
    assert steps[-1] == "Hello world, again and again! Hello world"


def test_it_decodes_each_streamed_token_a_bounded_number_of_times(byte_tokenizer):
    decoded = []
    real_decode = byte_tokenizer.decode

    def counting_decode(ids, skip_special_tokens=False):
        decoded.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    byte_tokenizer.decode = counting_decode
    ids = byte_tokenizer.encode("가나다 abc " * 200)  # 2,400 tokens

    detokenize_step_by_step(byte_tokenizer, ids)

    # A full decode per token would be ~2.9M ids; the tail decodes stay O(n).
    assert sum(decoded) < 10 * len(ids)


def test_it_reads_a_chat_template_saved_beside_the_config(tmp_path):
    # transformers 5's save_pretrained writes the template to chat_template.jinja.
    from transformers import PreTrainedTokenizerFast

    save_byte_tokenizer(tmp_path / "byte")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "byte/tokenizer.json"))
    hf.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    hf.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()

    tokenizer = load_tokenizer(tmp_path / "saved")

    assert tokenizer.chat_template == hf.chat_template
    assert (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=False
        )
        == "[hi]"
    )


# ------------------------------------------------------------ the prompt's BOS rule

RULE_TEXTS = {
    "english": "The library opens in the autumn of 2024, at 10:30.",
    "code": "def f(x):\n    return {'key': x ** 2}  # 12345\n",
    "korean": "파일을 찾을 수 없습니다. 다시 시도하십시오.",
}


@pytest.mark.parametrize("slice_name", sorted(RULE_TEXTS))
@pytest.mark.parametrize("model", ["demo", "real"])
def test_it_encodes_prompts_as_transformers_does(model, slice_name, request):
    from transformers import AutoTokenizer

    from gpuagent.benches import DEMO_MODEL_DIR

    model_dir = (
        DEMO_MODEL_DIR if model == "demo" else request.getfixturevalue("real_model_dir")
    )
    text = RULE_TEXTS[slice_name]
    ours = load_tokenizer(model_dir).encode_prompt(text)

    assert ours == AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    # the demo model is trained with BOS first; SmolLM2's tokenizer adds none
    starts_with_bos = ours[0] == load_tokenizer(model_dir).bos_token_id
    assert starts_with_bos is (model == "demo")


def write_tokenizer(path, post_processor=None, **config):
    vocab = {"a": 0, "b": 1, "<s>": 2, "</s>": 3}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = post_processor
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(path)


def test_it_takes_the_post_processors_bos_when_the_config_says_nothing(tmp_path):
    from tokenizers import processors

    template = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 2), ("</s>", 3)]
    )
    assert write_tokenizer(tmp_path, template).encode_prompt("ab") == [2, 0, 1, 3]
    assert write_tokenizer(tmp_path).encode_prompt("ab") == [0, 1]


def test_it_lets_the_configs_add_bos_token_decide(tmp_path):
    from tokenizers import processors

    template = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]
    )
    no_bos = write_tokenizer(tmp_path, template, add_bos_token=False)
    assert no_bos.encode_prompt("ab") == [0, 1]
    bos = write_tokenizer(tmp_path, add_bos_token=True, add_eos_token=True)
    assert bos.encode_prompt("ab") == [2, 0, 1, 3]
    # a prompt that a chat template started with BOS does not get a second one
    assert bos.encode_prompt("<s>ab") == [2, 0, 1, 3]


def backtracking_tokenizer() -> HFTokenizer:
    """The byte-level tokenizer behind a pre-tokenizer regex that backtracks
    catastrophically on a run of "a"s that does not end the text: the `tokenizers`
    package panics (PanicException, a BaseException) past onig's retry limit."""
    from tokenizers import Regex

    from gpuagent.engine.tokenizer import build_byte_tokenizer

    inner = build_byte_tokenizer()
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("(a+)+$"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return inner


def test_it_turns_a_tokenizer_panic_into_an_error_naming_it():
    from gpuagent.engine.tokenizer import TokenizerError, byte_tokenizer_config

    tokenizer = Tokenizer(backtracking_tokenizer(), byte_tokenizer_config())

    with pytest.raises(TokenizerError) as failed:
        tokenizer.encode_prompt("a" * 40 + "!")  # 41 characters
    after = tokenizer.encode("hello")

    assert "tokenizer failed" in str(failed.value)
    assert "PanicException" in str(failed.value)
    assert after == list(b"hello")


def test_it_refuses_to_load_a_tokenizer_that_panics_on_its_probe(tmp_path):
    save_byte_tokenizer(tmp_path)
    backtracking_tokenizer().save(str(tmp_path / "tokenizer.json"))

    with pytest.raises(TokenizerLoadError) as refused:
        load_tokenizer(tmp_path)

    message = str(refused.value)
    assert "tokenizer.json is refused" in message and "probe" in message
    assert "PanicException" in message and "aaaa" in message
