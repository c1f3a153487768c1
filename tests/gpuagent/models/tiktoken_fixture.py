"""A small tiktoken tokenizer made here: byte-level BPE merges trained on the demo
corpus (English docs, Korean catalogs, standard-library code) plus some Chinese,
split by Kimi K2's pattern, written as a `tiktoken.model`; and a
`tokenizer_config.json` laid out like Kimi K2's published one."""

from __future__ import annotations

import base64
import functools
import random
from collections import Counter
from pathlib import Path

import regex

from gpuagent.models import corpus
from gpuagent.models.tiktoken_patterns import KIMI_PATTERN

MERGES = 400
CHINESE = (
    "自然语言处理是人工智能的一个重要领域。模型把文本切分成词元，然后预测下一个词元。"
    "北京市的天气今天很好，我们去公园散步吧。中文English混合的句子也需要正确切分。"
    "这个服务器在图形处理器上运行大型语言模型，并且每一个模型文件都要经过检查。"
)


@functools.cache
def training_text() -> str:
    english = "\n".join(corpus.english_docs(heldout=False)[:40])[:40_000]
    pairs = corpus.korean_pairs(corpus.django_korean_catalogs(), heldout=False)
    korean = corpus.korean_plain_text(pairs)[:15_000]
    code = Path(regex.__file__).with_name("_main.py")
    code_text = code.read_text() if code.exists() else ""
    import json as json_module  # the standard library's own source as code

    code_text += Path(json_module.__file__).read_text()
    return "\n".join([english, korean, code_text[:20_000], CHINESE * 3])


def byte_ranks() -> dict[bytes, int]:
    """The 256 single bytes at ranks that are not their values (as in published
    rank files, where id == byte does not hold)."""
    order = sorted(range(256), key=lambda b: (b ^ 0x5A, b))
    return {bytes([b]): rank for rank, b in enumerate(order)}


@functools.cache
def trained_ranks(merges: int = MERGES) -> dict[bytes, int]:
    """Byte ranks, then `merges` BPE merges learned on the training text split by
    Kimi's pattern (the most frequent adjacent pair each time; ties by bytes)."""
    return _train(regex.findall(KIMI_PATTERN, training_text()), merges)


# Characters where two regex engines' classes could disagree (tiktoken runs the
# pattern in Rust's fancy-regex, tokenizers in Oniguruma): Unicode spaces, line
# separators, marks, Han against other letters, other numerals, contractions.
ALPHABET = (
    list("abcXYZ'sdtlmvre 019\n\r\t.,;!?-_()[]{}#@")
    + list("\u00a0\u3000\u2028\u2029\x0b\x0c\x85\u200b\ufeff\u0301\u0300")
    + list("가나다한국어中文字漢日本かなカナÀéßΩДж٣४Ⅻ½²")
    + ["🤖", "𝒳"]
)


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        for _ in range(count)
    ]


@functools.cache
def substring_ranks(longest: int = 12) -> dict[bytes, int]:
    """Byte ranks, then every substring of 2..`longest` bytes of the samples and of
    random_texts(1, 300), shorter first: tokens across every boundary the pattern
    draws, so a text split anywhere tiktoken does not split would merge across it
    and give other ids."""
    # (not the special tokens' text: tokenizers cannot give a special token an id
    # of its own when its text is also a BPE token; the converter refuses that)
    texts = [t for kind, t in SAMPLES.items() if kind != "specials"]
    source = [t.encode("utf-8") for t in [*texts, *random_texts(1, 300)]]
    found = {
        text[i : i + n]
        for text in source
        for n in range(2, longest + 1)
        for i in range(len(text) - n + 1)
    }
    ranks = byte_ranks()
    for token in sorted(found, key=lambda t: (len(t), t)):
        ranks[token] = len(ranks)
    return ranks


def _train(pieces: list[str], merges: int) -> dict[bytes, int]:
    ranks = byte_ranks()
    words = Counter(piece.encode("utf-8") for piece in pieces)
    parts = {w: [w[i : i + 1] for i in range(len(w))] for w in words}
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            p = parts[word]
            for i in range(len(p) - 1):
                pairs[p[i], p[i + 1]] += count
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for word in words:
            p = parts[word]
            i = 0
            while i < len(p) - 1:
                if p[i] == a and p[i + 1] == b:
                    p[i : i + 2] = [a + b]
                i += 1
    return ranks


def tiktoken_model_bytes(ranks: dict[bytes, int]) -> bytes:
    lines = (
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )
    return b"\n".join(lines) + b"\n"


# id offset in the special block -> content (the rest are reserved), as in Kimi K2's
# tokenizer_config.json
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    10: "<|im_system|>",
    15: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' "
    "+ message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def kimi_tokenizer_config(base: int) -> dict:
    """tokenizer_config.json as Kimi K2 publishes it (auto_map to its code)."""
    decoder = {
        str(base + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, content in NAMED_SPECIALS.items()
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>"],
        "bos_token": "[BOS]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }


def kimi_special_ids(base: int) -> dict[str, int]:
    """What tokenization_kimi gives tiktoken as special tokens."""
    return {
        NAMED_SPECIALS.get(i - base, f"<|reserved_token_{i}|>"): i
        for i in range(base, base + 256)
    }


SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog. It's what they'll do; "
    "we've seen I'M HERE and DON'T.",
    "korean": "모델 폴더의 파일은 모두 검사합니다. 안녕하세요, 반갑습니다!",
    "chinese": "中文English混合的句子。北京市 Pascal 汉字abc，自然语言处理！",
    "code": "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != 0:\n"
    '        print(f"{x!r}")\r\n',
    "whitespace": "a  b   c\n\n\n   \t\t  \n  x     \r\n\r\n  end   ",
    "digits": "1234567890 3.14159 2026-12-07 0x1F 100,000,000 ١٢٣ ４５６",
    "specials": "[BOS]<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>"
    "<|reserved_token_{r}|>[EOS]",
    "mixed": "Ünïcödé ñ émoji 🤖🚀 mixed 한국어 and 日本語 かな カナ — dash «quotes»",
}
