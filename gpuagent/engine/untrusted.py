"""Code from a model folder, run where it can be stopped: chat templates and the
first use of a tokenizer.json.

A chat template is a program (Jinja) and a tokenizer.json carries regexes, and both
come with the model folder. Jinja's sandbox (`ImmutableSandboxedEnvironment`, as
transformers and vLLM render templates) keeps a template away from Python's
internals, not from looping or allocating for ever; a pre-tokenizer regex that
backtracks catastrophically holds its thread until it gives up, if it does. A
thread can't be stopped, and one left running keeps burning a core, so both run in
child processes (`python -m gpuagent.engine.untrusted KIND MEMORY_BYTES`) under hard
limits, and a child past a limit is killed:

- time: `TEMPLATE_TIME_S` per render, `TOKENIZER_PROBE_S` for a tokenizer's probe
  (wall clock, then SIGKILL);
- memory: `TEMPLATE_MEMORY_BYTES` / `TOKENIZER_MEMORY_BYTES` of address space
  (RLIMIT_AS, set by the child on itself): an allocation past it is a MemoryError;
- output: `TEMPLATE_MAX_CHARS` characters of rendered prompt, counted as the
  template generates them.

`ChatTemplateRenderer` keeps up to `TEMPLATE_WORKERS` children for the server's
requests (a render past a limit raises `LimitError` naming it; a template that
refuses the messages, `TemplateRefusedError`) and `probe`s a template before the
server starts: one that does not compile or passes a limit on the sample
conversations is refused. `probe_tokenizer` encodes sample texts (runs of one
character ending in another, where a backtracking regex is slowest) with a
tokenizer.json in a child: one that panics, fails or passes a limit is refused.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TEMPLATE_TIME_S = 2.0
TEMPLATE_MEMORY_BYTES = 2**30
# Twice the largest request body (openai_api.MAX_BODY_BYTES): room for any wrapping a
# template adds around the messages, far below what would strain the server.
TEMPLATE_MAX_CHARS = 32 * 2**20
TEMPLATE_WORKERS = 4
TOKENIZER_PROBE_S = 10.0
TOKENIZER_MEMORY_BYTES = 4 * 2**30
# How long a child may take to start (interpreter, imports) before its first task.
CHILD_START_S = 60.0

WHAT = {"template": "the chat template", "tokenizer": "the tokenizer"}

PROBE_CONVERSATIONS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
)
PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world! It's 12:30 - héllo, 안녕하세요, 🙂.",
    *(c * 64 + end for c, end in [("a", "!"), ("A", "?"), ("1", "a"), ("가", "!")]),
    *(c * 64 + "x" for c in (" ", "\n", "\t", ".", "'")),
    "'s" * 32 + "!",
    "a1" * 32 + " ",
    "a " * 32 + "!",
)


class LimitError(ValueError):
    """Work from a model folder passed a limit (`limit`: "time", "memory" or
    "output"); the message names it."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class TemplateRefusedError(ValueError):
    """The chat template refused the messages (its own error, Jinja's or any
    other it raised); `syntax`: it does not even compile."""

    def __init__(self, message: str, syntax: bool = False) -> None:
        super().__init__(message)
        self.syntax = syntax


class ProbeError(ValueError):
    """A chat template or tokenizer failed its probe; the message says how."""


# --------------------------------------------------------------------- rendering


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> Any:
    """`template` compiled in Jinja's immutable sandbox, as transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: Any,
    eos_token: Any,
    max_chars: int | None = None,
) -> str:
    """Render a chat template in-process (LimitError past `max_chars`); no time or
    memory bound here: the server renders through `ChatTemplateRenderer`."""
    chunks: Iterator[str] = compile_template(template).generate(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if max_chars is not None and size > max_chars:
            raise LimitError(
                f"the chat template's output passed {max_chars} characters (the "
                "limit per request)",
                "output",
            )
        out.append(chunk)
    return "".join(out)


# ------------------------------------------------------------------------ parent


class _Child:
    """One child process, one task at a time: a JSON line in, a JSON line out
    (ASCII JSON: a lone surrogate a request carries survives the trip)."""

    def __init__(self, kind: str, memory_bytes: int) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, path])),
            "TOKENIZERS_PARALLELISM": "false",
            "RAYON_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-m", "gpuagent.engine.untrusted", kind]
        self.proc = subprocess.Popen(
            [*argv, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
        )
        self.pending = bytearray()
        try:
            ready = self._read_line(time.monotonic() + CHILD_START_S, "start")
        except (TimeoutError, EOFError, OSError):
            ready = b""
        if ready != b"ready":
            status = self.kill()
            raise RuntimeError(
                f"the {kind} child did not start (exit status {status}): "
                f"{ready[:200]!r}"
            )

    def call(self, task: dict[str, Any], time_s: float, what: str) -> dict[str, Any]:
        """The child's answer to `task` within `time_s` (LimitError otherwise,
        the child killed)."""
        deadline = time.monotonic() + time_s
        data = json.dumps(task).encode() + b"\n"
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.proc.stdin.fileno(), view) :]
            line = self._read_line(deadline, what)
        except TimeoutError:
            self.kill()
            raise LimitError(
                f"{what} took longer than {time_s:g} s (the limit) and was stopped",
                "time",
            ) from None
        except (OSError, EOFError):
            status = self.kill()
            raise RuntimeError(f"{what} crashed (exit status {status})") from None
        return json.loads(line)

    def _read_line(self, deadline: float, what: str) -> bytes:
        fd = self.proc.stdout.fileno()
        while (end := self.pending.find(b"\n")) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(what)
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError(what)
            self.pending += chunk
        line = bytes(self.pending[:end])
        del self.pending[: end + 1]
        return line

    def kill(self) -> int | None:
        """Stop the child now (SIGKILL) and reap it; its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        status = self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()
        return status


def _limit_or_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """The child's answer, or LimitError for one that passed a limit."""
    if answer.get("limit"):
        raise LimitError(answer["error"], answer["limit"])
    return answer


class ChatTemplateRenderer:
    """Renders chat templates in child processes under the limits (see the module
    docstring): at most `workers` at once, a child kept for the next render unless
    it passed a limit (then it is killed)."""

    def __init__(
        self,
        workers: int = TEMPLATE_WORKERS,
        time_s: float | None = None,
        max_chars: int | None = None,
    ) -> None:
        self.time_s = TEMPLATE_TIME_S if time_s is None else time_s
        self.max_chars = TEMPLATE_MAX_CHARS if max_chars is None else max_chars
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._closed = False

    def render(
        self,
        template: str,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        bos_token: Any = "",
        eos_token: Any = "",
    ) -> str:
        """The prompt text of `messages`. Raises LimitError (a limit passed),
        TemplateRefusedError (the template refused them) or RuntimeError (the
        child crashed)."""
        task = {
            "template": template,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
            "max_chars": self.max_chars,
        }
        with self._slots:
            child = self._take()
            try:
                answer = _limit_or_answer(
                    child.call(task, self.time_s, "rendering the chat template")
                )
            except BaseException:
                child.kill()  # its state after a limit is unknown
                raise
            self._give_back(child)
        if "text" not in answer:
            raise TemplateRefusedError(answer["error"], bool(answer.get("syntax")))
        return answer["text"]

    def probe(self, template: str, bos_token: Any = "", eos_token: Any = "") -> None:
        """Render the sample conversations (`PROBE_CONVERSATIONS`): ProbeError for
        a template that does not compile or passes a limit. A conversation the
        template refuses is not a failure (templates may require, say, a system
        message first)."""
        for messages in PROBE_CONVERSATIONS:
            try:
                self.render(
                    template, messages, bos_token=bos_token, eos_token=eos_token
                )
            except TemplateRefusedError as exc:
                if exc.syntax:
                    raise ProbeError(
                        f"the chat template does not compile: {exc}"
                    ) from None
            except (LimitError, RuntimeError) as exc:
                raise ProbeError(
                    f"the chat template failed its probe on {len(messages)} "
                    f"sample message(s): {exc}"
                ) from None

    def close(self) -> None:
        """Stop the idle children (a render under way finishes first)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self) -> _Child:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Child("template", TEMPLATE_MEMORY_BYTES)

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()


def probe_tokenizer(tokenizer_json: str, time_s: float | None = None) -> None:
    """Encode `PROBE_TEXTS` with `tokenizer_json` in a child within `time_s`
    (default TOKENIZER_PROBE_S): ProbeError naming the text that panicked or
    failed, or the limit passed."""
    time_s = TOKENIZER_PROBE_S if time_s is None else time_s
    child = _Child("tokenizer", TOKENIZER_MEMORY_BYTES)
    try:
        task = {"tokenizer_json": tokenizer_json, "texts": list(PROBE_TEXTS)}
        answer = _limit_or_answer(child.call(task, time_s, "the tokenizer's probe"))
    except (LimitError, RuntimeError) as exc:
        raise ProbeError(str(exc)) from None
    finally:
        child.kill()
    if "error" in answer:
        text = answer.get("text")
        on = f"encoding the probe text {text!r}" if text else "loading it"
        raise ProbeError(f"the tokenizer failed its probe, {on}: {answer['error']}")


# ------------------------------------------------------------------------- child


def _render_task(task: dict[str, Any]) -> dict[str, Any]:
    from jinja2 import TemplateError, TemplateSyntaxError

    try:
        text = render_template(
            task["template"],
            task["messages"],
            add_generation_prompt=task["add_generation_prompt"],
            bos_token=task["bos_token"],
            eos_token=task["eos_token"],
            max_chars=task["max_chars"],
        )
    except TemplateSyntaxError as exc:
        return {"error": f"syntax error: {exc}", "syntax": True}
    except TemplateError as exc:
        return {"error": str(exc)}
    return {"text": text}


def _encode_task(task: dict[str, Any]) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(task["tokenizer_json"])
    for text in task["texts"]:
        try:
            tokenizer.encode(text)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException
            return {"text": text, "error": f"{type(exc).__name__}: {exc}"}
    return {}


def child_main(kind: str, memory_bytes: int) -> None:
    """A child's loop: limit its own address space, import what its tasks need,
    say `ready`, then answer one JSON task per line until stdin closes."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    handle = {"template": _render_task, "tokenizer": _encode_task}[kind]
    if kind == "template":
        import jinja2.sandbox  # noqa: F401 - before the first task's clock starts
    else:
        import tokenizers  # noqa: F401
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            answer = handle(json.loads(line))
        except MemoryError:
            answer = {
                "limit": "memory",
                "error": f"{WHAT[kind]} ran out of its {memory_bytes // 2**20} MiB "
                "of memory (the limit) and was stopped",
            }
        except LimitError as exc:
            answer = {"limit": exc.limit, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the template's own, say
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]))
