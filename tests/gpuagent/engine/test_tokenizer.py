"""gpuagent.engine.tokenizer: the byte-level tokenizer and loading tokenizer.json."""

import json

import pytest

from gpuagent.engine.tokenizer import (
    BYTE_VOCAB_SIZE,
    SPECIAL_TOKENS,
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
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "elsewhere", files={})
