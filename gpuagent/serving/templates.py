"""Command templates for external OpenAI-compatible engines.

A template is one command line with `{placeholder}` fields, split into an argv list
with `shlex` (quotes group words) and never run through a shell: a value with spaces
or `;` stays one argument. Placeholders are substituted per argument; `{{`/`}}` are
literal braces. A list placeholder (`{served_model_names}`: the release's model name,
then `model@version`; `{quantization_args}`: the flags of the folder's weight
format, none for unquantized weights) stands alone as an argument and becomes one
argument per word, none for an empty list.
An unknown placeholder, a list placeholder inside a word, a format spec or conversion
(`{port:>5}`, `{model_dir!r}`), attribute or index access, or an empty template is
refused with a `TemplateError` that names it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

from gpuagent.protocol import (
    AGENT_PRESET_TEMPLATES,
    TEMPLATE_LIST_PLACEHOLDERS,
    TEMPLATE_PLACEHOLDERS,
    allowed_shape_problem,
    command_template_words,
    template_fields,
)
from gpuagent.serving.errors import TemplateError

PLACEHOLDERS = TEMPLATE_PLACEHOLDERS
LIST_PLACEHOLDERS = TEMPLATE_LIST_PLACEHOLDERS

# Named presets: the template and how our KV-cache dtype names map to the engine's
# flag values (a dtype missing from the map is refused, never passed through).
# vllm: `--quantization compressed-tensors` only for a folder with a
# quantization_config (vLLM refuses the flag without one: a bf16/fp16 release has
# none), a bounded `--max-model-len` and `--gpu-memory-utilization`; the weights'
# dtype is the checkpoint's (config.json `dtype`/`torch_dtype`), and fp8 KV scales
# are read from the checkpoint (`kv_cache_scheme`).
PRESETS: dict[str, tuple[str, dict[str, str]]] = {
    # vLLM's "auto" is the checkpoint's dtype (bf16 for compressed-tensors
    # int4/int8 weight-only checkpoints); it has no int8/int4 KV cache.
    "vllm": (AGENT_PRESET_TEMPLATES["vllm"], {"fp8": "fp8", "bf16": "auto"}),
}


# Flag or variable names whose value is a secret (`--api-key X`, `--hf-token=X`,
# `HF_TOKEN=X`): their values never leave the agent in a report. A public key's
# path is no secret.
SECRET_NAME = re.compile(
    r"(token|secret|passw|credential|private|api[-_]?key|^key$|(?<!public)[-_]key$)",
    re.I,
)
REDACTED = "***"


def redacted_command(argv: Sequence[str]) -> list[str]:
    """`argv` as a report may show it: the value of every flag or NAME=value word
    whose name says secret (SECRET_NAME) replaced by ***."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _value = word.partition("=")
        bare = name.lstrip("-")
        if eq and SECRET_NAME.search(bare):
            out.append(f"{name}={REDACTED}")
            continue
        out.append(word)
        hide_next = word.startswith("-") and not eq and bool(SECRET_NAME.search(bare))
    return out


def quantization_args(quantized: bool) -> list[str]:
    """`{quantization_args}`: how an OpenAI-compatible engine is told the weights'
    format. A folder with a quantization_config (int8, int4, fp8 weights, or dense
    weights with fp8 KV scales) is compressed-tensors; one without gets no flag."""
    return ["--quantization", "compressed-tensors"] if quantized else []


def parse_template(template: str) -> list[str]:
    """Split `template` into argv tokens and check every placeholder.

    Raises TemplateError: empty, unbalanced quotes or braces, unknown or malformed
    placeholders (all of them named), or a program that is not a literal word or
    `{python}` (the grammar is gpuagent.protocol's, checked on both sides)."""
    try:
        return command_template_words(template)
    except ValueError as e:
        raise TemplateError(str(e)) from None


def check_allowed_shape(template: str, allowed_programs: Collection[str]) -> None:
    """Raise TemplateError unless `template` is one of `allowed_programs` (an
    agent's own setting) word for word: each entry a preset's name (its template)
    or a command template of its own (gpuagent.protocol.allowed_shape_problem,
    which the control plane checks an enrolled agent's record with too)."""
    try:
        problem = allowed_shape_problem(
            template, allowed_programs, {n: t for n, (t, _) in PRESETS.items()}
        )
    except ValueError as e:
        raise TemplateError(str(e)) from None
    if problem:
        raise TemplateError(problem)


def placeholders(template: str) -> set[str]:
    """The placeholders `template` uses (checked as parse_template checks them)."""
    return {name for token in parse_template(template) for name in _fields(token)}


def render_command(
    template: str, values: Mapping[str, str | Sequence[str]]
) -> list[str]:
    """The argv list of `template` with `values` substituted (see the module
    docstring; a list placeholder's value is a list of words, or one word). Every
    placeholder the template uses must have a value."""
    tokens = parse_template(template)
    used = {name for token in tokens for name in _fields(token)}
    absent = sorted(used - values.keys())
    if absent:
        raise TemplateError(f"no value for placeholder(s): {', '.join(absent)}")
    words = {k: v for k, v in values.items() if k not in LIST_PLACEHOLDERS}
    argv: list[str] = []
    for token in tokens:
        name = token[1:-1]
        if name in LIST_PLACEHOLDERS and token == "{" + name + "}":
            value = values[name]
            argv += [value] if isinstance(value, str) else [str(v) for v in value]
        else:
            argv.append(token.format_map({k: str(v) for k, v in words.items()}))
    if not argv or not argv[0]:
        raise TemplateError("the command template's program is empty")
    return argv


def preset_template(name: str, kv_cache_dtype: str) -> tuple[str, str]:
    """(template, the engine's KV flag value) of the preset `name` for our
    `kv_cache_dtype`. Raises TemplateError for an unknown preset or a dtype the
    preset's engine does not offer."""
    if name not in PRESETS:
        raise TemplateError(
            f"unknown serving preset {name!r}; known: {', '.join(sorted(PRESETS))}"
        )
    template, kv_map = PRESETS[name]
    if kv_cache_dtype not in kv_map:
        raise TemplateError(
            f"preset {name!r} has no KV cache dtype {kv_cache_dtype!r} "
            f"(it offers {', '.join(sorted(kv_map))})"
        )
    return template, kv_map[kv_cache_dtype]


def _fields(token: str) -> list[str]:
    try:
        return template_fields(token)
    except ValueError as e:
        raise TemplateError(str(e)) from None
