"""Model-folder code in child processes under limits (gpuagent.engine.untrusted):
real children, real templates and tokenizers, each limit passed for real."""

import os
import time
from pathlib import Path

import pytest

import gpuagent.engine.untrusted as untrusted
from gpuagent.engine.tokenizer import CHAT_TEMPLATE, build_byte_tokenizer
from gpuagent.engine.untrusted import (
    ChatTemplateRenderer,
    LimitError,
    ProbeError,
    TemplateRefusedError,
    probe_tokenizer,
)

HELLO = [{"role": "user", "content": "hello"}]
NESTED_LOOPS = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)
HUGE_STRING = "{{ 'x' * 4000000000 }}"  # about 4 GB in one allocation
LONG_OUTPUT = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"  # 100 MB


def untrusted_children() -> dict[int, str]:
    """pid -> state of this process's children that run untrusted code."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and b"gpuagent.engine.untrusted" in cmdline:
            found[int(entry.name)] = stat[0]
    return found


@pytest.fixture
def renderer():
    renderer = ChatTemplateRenderer(workers=2)
    yield renderer
    renderer.close()


def test_it_renders_as_the_in_process_sandbox_does(renderer):
    tokens = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}

    rendered = renderer.render(CHAT_TEMPLATE, HELLO, **tokens)
    again = renderer.render(CHAT_TEMPLATE, HELLO, **tokens)

    expected = untrusted.render_template(
        CHAT_TEMPLATE, HELLO, add_generation_prompt=True, **tokens
    )
    assert (
        rendered
        == again
        == expected
        == "<|bos|><|user|>\nhello<|eos|>\n<|assistant|>\n"
    )
    assert len(untrusted_children()) == 1  # the child is kept for the next render


@pytest.mark.parametrize(
    ("template", "limit", "named"),
    [
        (NESTED_LOOPS, "time", "longer than 2 s"),
        (HUGE_STRING, "memory", "1024 MiB"),
        (LONG_OUTPUT, "output", "33554432 characters"),
    ],
)
def test_it_stops_a_template_past_a_limit_and_names_it(
    renderer, template, limit, named
):
    started = time.monotonic()

    with pytest.raises(LimitError) as stopped:
        renderer.render(template, HELLO)
    took_s = time.monotonic() - started
    after = renderer.render(CHAT_TEMPLATE, HELLO)

    assert stopped.value.limit == limit
    assert named in str(stopped.value)
    assert took_s < untrusted.TEMPLATE_TIME_S + 1
    assert after.endswith("<|assistant|>\n")
    # the child that passed the limit is gone: only the idle one is left, asleep
    assert list(untrusted_children().values()) == ["S"]


def test_it_reports_what_the_template_refuses(renderer):
    with pytest.raises(TemplateRefusedError) as refused:
        renderer.render("{{ raise_exception('roles must alternate') }}", HELLO)
    with pytest.raises(TemplateRefusedError) as broken:
        renderer.render("{% for %}", HELLO)

    assert "raise_exception" in str(refused.value) and not refused.value.syntax
    assert broken.value.syntax


@pytest.mark.parametrize(
    ("template", "named"),
    [
        (NESTED_LOOPS, "longer than 2 s"),
        (HUGE_STRING, "MiB of memory"),
        ("{% if %}", "does not compile"),
    ],
)
def test_its_probe_refuses_a_template_that_fails_it(renderer, template, named):
    with pytest.raises(ProbeError) as refused:
        renderer.probe(template)

    assert named in str(refused.value)


def test_its_probe_takes_a_template_that_refuses_some_conversations(renderer):
    needs_system = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )

    renderer.probe(needs_system)
    renderer.probe(CHAT_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")


def test_it_stops_a_tokenizer_probe_past_its_time_limit(monkeypatch):
    monkeypatch.setattr(untrusted, "PROBE_TEXTS", ("a" * 2_000_000,))
    text = build_byte_tokenizer().to_str()

    with pytest.raises(ProbeError) as refused:
        probe_tokenizer(text, time_s=0.05)
    probe_tokenizer(text)  # the same tokenizer, within the default limit

    assert "longer than 0.05 s" in str(refused.value)
    assert untrusted_children() == {}
