"""Tokenizers for served models: a model folder's `tokenizer.json` through the
`tokenizers` package, plus the byte-level tokenizer the demo model is trained with.

The byte-level vocabulary is id == byte value for 0..255, then SPECIAL_TOKENS, so any
UTF-8 text (Korean included) encodes to its bytes and decodes back exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from gpuagent.engine.untrusted import ProbeError, probe_tokenizer, render_template

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
)
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # 264


class TokenizerLoadError(ValueError):
    """Tokenizer files missing or unreadable; the message says which and why."""


class TokenizerError(ValueError):
    """The tokenizer failed on a text (its Rust code panicked, e.g. a pre-tokenizer
    regex past its backtracking limit); the message says so."""


CHAT_TEMPLATE_FILE = "chat_template.jinja"
REPLACEMENT_CHAR = "\ufffd"  # what a cut-off UTF-8 character decodes to

# One turn per message, each closed by eos; the generation prompt opens an assistant
# turn so the model's eos ends its answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHAT_ROLES = ("system", "user", "assistant")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids and chat template the engine needs."""

    def __init__(
        self, inner: HFTokenizer, config: dict[str, Any] | None = None
    ) -> None:
        self.inner = inner
        self.config = config or {}
        self.bos_token = self.config.get("bos_token")
        self.eos_token = self.config.get("eos_token")
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.chat_template: str | None = self.config.get("chat_template")
        self.prompt_prefix_ids, self.prompt_suffix_ids = self._prompt_affixes()

    def _id_of(self, token: Any) -> int | None:
        if isinstance(token, dict):  # HF AddedToken serialization
            token = token.get("content")
        return None if token is None else self.inner.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it map to their ids.
        TokenizerError where the tokenizer fails on it."""
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.inner.encode(text, add_special_tokens=add_special_tokens).ids
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException
            raise TokenizerError(
                f"the model's tokenizer failed on this text ({type(exc).__name__}: "
                f"{exc})"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt by the tokenizer's own rule (what transformers'
        `tokenizer(text)` gives): the BOS/EOS `tokenizer_config.json` asks for with
        `add_bos_token` / `add_eos_token`, or, where it sets neither, whatever the
        post-processor of tokenizer.json adds (nothing, for most byte-level BPEs).

        A prompt whose text already starts with the prefix (a chat template that
        writes `{{ bos_token }}`) does not get it twice."""
        ids = self.encode(text)
        prefix = self.prompt_prefix_ids
        if prefix and ids[: len(prefix)] == prefix:
            prefix = []
        return [*prefix, *ids, *self.prompt_suffix_ids]

    def _prompt_affixes(self) -> tuple[list[int], list[int]]:
        # (ids before, ids after) the text that encode_prompt adds
        flags = ("add_bos_token", "add_eos_token")
        if any(flag in self.config for flag in flags):
            bos, eos = self.bos_token_id, self.eos_token_id
            add_bos = bool(self.config.get("add_bos_token")) and bos is not None
            add_eos = bool(self.config.get("add_eos_token")) and eos is not None
            return ([bos] if add_bos else []), ([eos] if add_eos else [])
        # The post-processor's template, read off one encoding of a probe text.
        plain = self._encode("a", add_special_tokens=False)
        full = self._encode("a", add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        raise TokenizerLoadError(
            "the tokenizer's post-processor changes the text's own tokens"
        )

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (a cut-off UTF-8 sequence decodes to U+FFFD)."""
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat `messages` ({"role", "content"}) to the prompt text, in
        Jinja's sandbox, in this process: the server renders a template under time
        and memory limits instead (`untrusted.ChatTemplateRenderer`)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        return render_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoding only its unsettled tail per call
    (vLLM's prefix/read offsets), so streaming n tokens costs O(n), not O(n^2).

    Text up to `read_offset` is settled: it decoded without a trailing U+FFFD (a
    UTF-8 character cut off). Each call decodes ids[prefix_offset:], where the
    tokens prefix_offset..read_offset-1 are context so that decoders which treat a
    first token specially (SentencePiece's leading space) see the same first token
    as a full decode would, and keeps what comes after their text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.settled = ""  # text of ids[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def text(self, ids: list[int]) -> str:
        """Text of all of `ids`, which extend the ids of every earlier call."""
        prefix = self._decode(ids[self.prefix_offset : self.read_offset])
        tail = self._decode(ids[self.prefix_offset :])[len(prefix) :]
        if tail and not tail.endswith(REPLACEMENT_CHAR):
            self.settled += tail
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return self.settled
        return self.settled + tail


def build_byte_tokenizer() -> HFTokenizer:
    """A `tokenizers.Tokenizer` with one token per byte (id == byte) + specials."""
    # ByteLevel maps each byte to a printable unicode char; a BPE model with those 256
    # chars as its vocab and no merges then emits exactly one token per byte.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_chars) == sorted(byte_to_char.values())
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    # The demo model is trained on documents that start with BOS: prompts get it too
    # (transformers reads this post-processor; tokenizer_config says add_bos_token).
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B:1",
        special_tokens=[(bos, 256)],
    )
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable-char mapping, which tokenizers' ByteLevel also uses.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer_config() -> dict[str, Any]:
    """`tokenizer_config.json` contents for the byte-level tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_byte_tokenizer(model_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the byte-level tokenizer."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(model_dir / "tokenizer.json"))
    config_text = json.dumps(byte_tokenizer_config(), indent=2, ensure_ascii=False)
    (model_dir / "tokenizer_config.json").write_text(config_text + "\n")


def load_tokenizer(
    model_dir: str | Path, files: Mapping[str, bytes] | None = None
) -> Tokenizer:
    """Load `tokenizer.json` (+ `tokenizer_config.json` and `chat_template.jinja` when
    present) from a folder.

    With `files` (names relative to model_dir -> bytes, as verify-on-load returns
    them) only those bytes are used, as in `loader.load_model`. The tokenizer first
    encodes sample texts in a child process within a time limit
    (`untrusted.probe_tokenizer`): one that panics or hangs there is refused.
    """
    if files is None:
        model_dir = Path(model_dir)
        names = ("tokenizer.json", "tokenizer_config.json", CHAT_TEMPLATE_FILE)
        files = {
            n: (model_dir / n).read_bytes() for n in names if (model_dir / n).exists()
        }
    if "tokenizer.json" not in files:
        raise TokenizerLoadError(f"no tokenizer.json in {model_dir}")
    try:
        text = files["tokenizer.json"].decode("utf-8")
        inner = HFTokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise TokenizerLoadError(f"tokenizer.json is not a valid tokenizer: {e}") from e
    try:
        probe_tokenizer(text)
    except ProbeError as e:
        raise TokenizerLoadError(f"tokenizer.json is refused: {e}") from None
    config_bytes = files.get("tokenizer_config.json")
    try:
        # Decoded first, so a UTF-8 byte-order mark is refused as by transformers.
        config_text = config_bytes.decode("utf-8") if config_bytes is not None else "{}"
        config = json.loads(config_text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise TokenizerLoadError(f"tokenizer_config.json is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise TokenizerLoadError("tokenizer_config.json is not a JSON object")
    if CHAT_TEMPLATE_FILE in files:
        # transformers 5 saves the template beside the config; as there, it wins.
        try:
            config["chat_template"] = files[CHAT_TEMPLATE_FILE].decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerLoadError(f"{CHAT_TEMPLATE_FILE} is not UTF-8: {e}") from e
    return Tokenizer(inner, config)
