"""Decode speed vs llama.cpp (issue 33 item 2):
`python -m gpuagent.benches.llamacpp [--model-dir DIR] [--folder W4A16_DIR]`.

Batch-1 greedy decode of SmolLM2-135M on a CPU, `--threads` (2) each: our engine on
a w4a16-g128 folder made by the project's own compress pipeline (RTN, as the compress
bench's "w4a16-g128 rtn" row; `--folder` reuses one) against llama.cpp on the same
model's Q4_1 GGUF (`gpuagent.models.smollm2`), the GGUF the project's model was
converted from. Same prompt token ids, same number of new tokens, rounds alternating
(ours, peer, ours, peer, ...) in one run so the shared machine's load falls on both;
best round of each. Decode time excludes prompt processing on both sides, timed the
same way within one request: from the first generated token to the N-th, over
N - 1 steps (ours from the engine's steps, the peer's inside the node process).

The peer is node-llama-cpp's prebuilt CPU llama.cpp (`make llama-cpp-peer` installs
it into the git-ignored var/node-llama-cpp; never built from source, no model
downloaded), driven by `llamacpp_peer.mjs` as a subprocess. It is optional: without
it (or without node) the row is skipped with a message saying how to get it, exit 0.

The like-for-like row is ours with the output head at the GGUF's own head
precision (`gguf_head_format`, read from the file: SmolLM2's Q4_1 GGUF keeps its
tied head in Q8_0, which our "int8" head is: the model was converted from that
GGUF, so an int8 copy of its float32 head is the GGUF's exactly; of the w4a16
folder's bf16 head, the same codes with scales within 0.05%). That head comes with
the release: a second w4a16-g128 folder compressed with the recipe option
head="int8" (`gpuagent.compress.head`; `--head-folder` reuses one), served as any
release is, no engine flag; the same codes the engine's `quantize_head="int8"`
makes of the first folder's head at serve time. Prints,
like-for-like first: tokens/s ratio ours / peer at `--threads` (2) each and
PASS/FAIL vs the 0.5x target, then the same ratio against the peer's faster of 1
and 2 threads, also judged: on a loaded machine llama.cpp's spinning 2-thread pool
can run several times slower than its 1 thread, and our engine's decode layers run
on one thread anyway
(`Transformer.small_step_threads`), so 2-vs-2 alone would flatter us. Then, for
information, ours with the checkpoint's float32 head (as served by default) and
its two ratios, each side's tokens/s and ms/step, ours with the other
`quantize_head` copies, and how many greedy tokens agree before the first
difference: the like-for-like run vs the float-head run, and vs llama.cpp (Q4_1
with llama.cpp's int8 activations vs our w4a16 of the converted model: they drift;
measured 0/32, the first token already differs, not looked into).

Also for information: whether our decode steps ran each layer as one call
(`kernels.int4_layer`, the engine's path for a float32 model with int4 weights on a
CPU; the torch layers otherwise); the like-for-like run with the engine option
`int8_activations` (the int4 layers' activations rounded to int8 per block of 32 as
llama.cpp's Q8_1, integer int4 x int8 dot products: `kernels.int4_cpu`), its two
ratios and speed, and its quality cost against the same run with float32
activations: greedy tokens equal before the first difference, and mean KLD and same
top-1 teacher-forced over the eval slices' first passages (`int8_activation_quality`,
fed `int4_cpu.MAX_ROWS` tokens a chunk so every matmul runs the decode kernel).
The exit status is 1 when a judged row fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gpuagent.benches.engine import THROUGHPUT_PROMPTS, Row
from gpuagent.protocol import HEAD_FORMATS as RECIPE_HEAD_FORMATS

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_DIR = REPO_ROOT / "var" / "node-llama-cpp"
PEER_SCRIPT = Path(__file__).with_name("llamacpp_peer.mjs")
# tokens/s of ours over llama.cpp's on the Q4_1 GGUF, 2 threads each (issue 33)
TARGET_RATIO = 0.5
GET_PEER = (
    "llama.cpp peer skipped: node-llama-cpp is not installed; `make llama-cpp-peer` "
    f"installs its prebuilt CPU build into {PEER_DIR.relative_to(REPO_ROOT)} "
    "(needs node >= 20 and the npm registry once; nothing is built or downloaded "
    "at bench time)"
)


class PeerUnavailable(RuntimeError):
    """node or node-llama-cpp is missing; the message says how to get it."""


def peer_missing(peer_dir: Path = PEER_DIR) -> str | None:
    """Why the peer can't run (a how-to message), or None when it can."""
    if shutil.which("node") is None:
        return "llama.cpp peer skipped: `node` is not on PATH (node >= 20 needed)"
    if not (peer_dir / "node_modules" / "node-llama-cpp" / "package.json").is_file():
        if peer_dir.resolve() == PEER_DIR:
            return GET_PEER
        return f"llama.cpp peer skipped: no node-llama-cpp in {peer_dir}"
    return None


class LlamaCppPeer:
    """One node process holding llama.cpp with the GGUF loaded; `decode` runs one
    greedy request and returns (tokens, decode seconds of N - 1 steps)."""

    def __init__(
        self, gguf: Path, threads: int, peer_dir: Path = PEER_DIR, context: int = 512
    ) -> None:
        missing = peer_missing(peer_dir)
        if missing:
            raise PeerUnavailable(missing)
        args = [str(peer_dir), str(gguf), str(threads), str(context)]
        self.proc = subprocess.Popen(
            ["node", str(PEER_SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.info = self._read()
        if not self.info.get("ready"):
            raise PeerUnavailable(f"llama.cpp peer did not start: {self.info}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip()
            self.proc.wait()
            raise PeerUnavailable(
                f"llama.cpp peer exited ({self.proc.returncode}): {err[-2000:]}"
            )
        return json.loads(line)

    def decode(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
        self.proc.stdin.write(
            json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n"
        )
        self.proc.stdin.flush()
        out = self._read()
        return out["tokens"], out["decode_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def our_decode(engine, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Our greedy tokens and decode seconds of N - 1 steps, timed as the peer times
    its own: from the step that gives the first token (the prompt's last) to the
    one that gives the N-th, so prefill is excluded within one run."""
    from gpuagent.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    request_id = f"llamacpp-bench-{next(_REQUEST_IDS)}"
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    first = last = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and len(out.token_ids) > len(tokens):
                tokens = out.token_ids
                last = time.perf_counter()
                first = first or last
    if len(tokens) != new_tokens:
        raise RuntimeError(f"asked {new_tokens} tokens, got {len(tokens)}")
    return tokens, last - first


_REQUEST_IDS = itertools.count()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# A GGUF output-head tensor type -> the `quantize_head` format of that precision
# (None: the checkpoint's float head). Q8_0 is group-32 symmetric int8 with one
# scale a group, which the "int8" copy at its default group (32) is.
GGUF_HEAD_FORMATS = {"F32": None, "Q8_0": "int8", "BF16": "bf16"}


def gguf_head_format(gguf: Path) -> tuple[str, str | None]:
    """(the GGUF's output-head tensor type, our head format of that precision):
    its `output.weight`, or the tied `token_embd.weight` where it has none.
    ValueError for a file with neither, or a type with no head format here."""
    from gpuagent.models.from_gguf import read_gguf

    tensors = read_gguf(gguf).tensors
    name = next(
        (n for n in ("output.weight", "token_embd.weight") if n in tensors), None
    )
    if name is None:
        raise ValueError(f"{gguf} has neither output.weight nor token_embd.weight")
    kind = tensors[name].tensor_type.name
    if kind not in GGUF_HEAD_FORMATS:
        raise ValueError(
            f"{gguf}: head {name} is {kind}; no head format of that precision "
            f"(known: {sorted(GGUF_HEAD_FORMATS)})"
        )
    return kind, GGUF_HEAD_FORMATS[kind]


def w4a16_folder(model_dir: Path, out_dir: Path, head: str | None = None) -> Path:
    """A w4a16-g128 (RTN) folder of `model_dir` by the project's compress pipeline;
    with `head` ("int8") the recipe option that writes the output head so."""
    from gpuagent.compress.pipeline import compress

    recipe = {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"}
    if head is not None:
        recipe["head"] = head
    return Path(compress(model_dir, recipe, out_dir).out_dir)


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    """`num_tokens` prompt ids of text from outside the project: the held-out
    passages (`gpuagent.evaluate.evalsets`, English, code, Korean) one after
    another, encoded as the engine encodes a prompt. ValueError where they hold
    fewer tokens."""
    from gpuagent.evaluate.evalsets import load_heldout_passages

    text = "\n\n".join(p.text for p in load_heldout_passages())
    ids = tokenizer.encode_prompt(text)
    if len(ids) < num_tokens:
        raise ValueError(
            f"--prompt-tokens {num_tokens}: the held-out passages hold {len(ids)}"
        )
    return ids[:num_tokens]


def decode_rows(
    folder: Path,
    gguf: Path,
    threads: int,
    new_tokens: int,
    rounds: int,
    peer_dir: Path = PEER_DIR,
    head_folder: Path | None = None,
    prompt_tokens: int = 0,
) -> list[Row | str]:
    """The table: rounds alternate ours (each head) / peer at `threads` / peer at
    1 thread; best round each (the first round warms up). The like-for-like row
    runs `head_folder` (`folder` compressed with the recipe's head at the GGUF's
    head precision) as it is; None: `folder` with that head copied at serve time
    (the engine's `quantize_head`). The prompt: a short one (0), or
    `prompt_tokens` of held-out text (`long_prompt`), so each step attends over
    that much context on both sides."""
    from gpuagent.engine.engine import LLMEngine
    from gpuagent.engine.weights import HEAD_FORMATS, Int8ActivationsError

    torch.set_num_threads(threads)
    head_type, like_head = gguf_head_format(gguf)
    float_head = "ours, float32 head"
    like = float_head if like_head is None else f"ours, {like_head} head ({head_type})"
    # like-for-like (and it with int8 activations, below), then as served by
    # default, then (information) the other
    # `quantize_head` copies of the float head, which a profile puts at about a
    # third of the step
    heads = {like: like_head, float_head: None}
    heads.update(
        (f"ours, {fmt} head copy", fmt) for fmt in HEAD_FORMATS if fmt != like_head
    )

    context = max(512, prompt_tokens + new_tokens + 16)
    kv_bytes = max(64 << 20, 2 * context * (24 << 10))  # SmolLM2: 23 KiB/token

    def engine(model_dir: Path, head: str | None, int8_activations: bool) -> LLMEngine:
        return LLMEngine.from_model_dir(
            model_dir,
            device="cpu",
            max_num_seqs=1,
            kv_memory_bytes=kv_bytes,
            quantize_head=head,
            int8_activations=int8_activations,
        )

    def like_engine(int8_activations: bool) -> LLMEngine:
        if head_folder is not None and like_head is not None:
            return engine(head_folder, None, int8_activations)  # the release's head
        return engine(folder, like_head, int8_activations)

    engines = {like: like_engine(False)}
    # the like-for-like run with int8 activations, where the folder has int4
    # weights for them (`engine.weights.use_int8_activations`)
    like_q8 = f"{like}, int8 activations"
    q8_refused = None
    try:
        engines[like_q8] = like_engine(True)
    except Int8ActivationsError as error:
        q8_refused = f"{like_q8} skipped: {error}"
    engines.update(
        (label, engine(folder, head, False))
        for label, head in heads.items()
        if label != like
    )
    prompt = engines[like].encode_prompt(THROUGHPUT_PROMPTS[0])
    if prompt_tokens:
        prompt = long_prompt(engines[like].tokenizer, prompt_tokens)
    steps = new_tokens - 1
    missing = peer_missing(peer_dir)
    best = dict.fromkeys(engines, math.inf)
    tokens: dict[str, list[int]] = {}
    peers: dict[str, LlamaCppPeer] = {}
    try:
        if missing is None:
            peers = {
                f"llama.cpp {threads} threads": LlamaCppPeer(
                    gguf, threads, peer_dir, context
                ),
            }
            if threads != 1:
                peers["llama.cpp 1 thread"] = LlamaCppPeer(gguf, 1, peer_dir, context)
            best.update(dict.fromkeys(peers, math.inf))
        for round_ in range(rounds + 1):  # the first round warms up
            for name, engine in engines.items():
                tokens[name], seconds = our_decode(engine, prompt, new_tokens)
                if round_:
                    best[name] = min(best[name], seconds / steps)
            for name, peer in peers.items():
                tokens[name], seconds = peer.decode(prompt, new_tokens)
                if round_:
                    best[name] = min(best[name], seconds / steps)
    finally:
        for peer in peers.values():
            peer.close()

    def speed(name: str) -> Row:
        return Row(
            f"{name} decode tok/s ({best[name] * 1e3:.1f} ms/step)",
            f"{1 / best[name]:.1f}",
            "",
            None,
        )

    rows: list[Row | str] = [
        f"SmolLM2-135M w4a16-g128 batch 1 greedy decode, {threads} threads each, "
        f"prompt {len(prompt)} tokens, {new_tokens} new, best of {rounds} "
        f"alternating rounds; the GGUF's head is {head_type}"
        + (
            f", ours from the recipe option head={like_head!r}"
            if head_folder is not None and like_head is not None
            else ""
        ),
    ]
    same_head = Row(
        f"greedy tokens of {like} equal to the float head's before the first "
        "difference",
        f"{common_prefix(tokens[like], tokens[float_head])}/{new_tokens}",
        "",
        None,
    )
    one_call = Row(
        f"{like}: each decode step's layers one call each (kernels.int4_layer)",
        "yes" if getattr(engines[like].model, "int4_decode", None) else "no",
        "",
        None,
    )
    q8_quality = [q8_refused] if q8_refused is not None else []
    if q8_refused is None:
        kld, top1, positions = int8_activation_quality(
            engines[like].model, engines[like_q8].model, engines[like].tokenizer
        )
        q8_quality = [
            Row(
                f"greedy tokens of {like_q8} equal to float activations' before the "
                "first difference",
                f"{common_prefix(tokens[like_q8], tokens[like])}/{new_tokens}",
                "",
                None,
            ),
            Row(
                f"int8 activations vs float: mean KLD over {positions} positions",
                f"{kld:.2e}",
                "",
                None,
            ),
            Row("int8 activations vs float: same top-1", f"{top1:.1%}", "", None),
        ]
    if missing is not None:
        rows += [speed(name) for name in engines]
        rows.append(one_call)
        if like != float_head:
            rows.append(same_head)
        rows += q8_quality
        rows.append(missing)
        return rows
    peer_2 = f"llama.cpp {threads} threads"
    peer_info = next(iter(peers.values())).info
    # the peer's best use of the same cores: under load llama.cpp's 2-thread pool
    # can lose to its own 1 thread (our layers run 1-thread at decode too)
    fastest = min(best[name] for name in peers)

    def ratios(name: str, judged: bool) -> list[Row]:
        out = [(f"{name} / {peer_2} (Q4_1) decode tok/s", best[peer_2] / best[name])]
        if len(peers) > 1:
            out.append(
                (
                    f"{name} / llama.cpp at its faster of 1 and {threads} threads",
                    fastest / best[name],
                )
            )
        return [
            Row(
                label,
                f"{ratio:.2f}x",
                f">= {TARGET_RATIO}x" if judged else "",
                ratio >= TARGET_RATIO if judged else None,
            )
            for label, ratio in out
        ]

    rows += ratios(like, judged=True)
    if like_q8 in engines:
        rows += ratios(like_q8, judged=False)
    if like != float_head:
        rows += ratios(float_head, judged=False)
    rows += [speed(name) for name in engines]
    rows += [
        Row(
            f"{name} (Q4_1, {peer_info.get('build')}) decode tok/s "
            f"({best[name] * 1e3:.1f} ms/step)",
            f"{1 / best[name]:.1f}",
            "",
            None,
        )
        for name in peers
    ]
    rows.append(one_call)
    if like != float_head:
        rows.append(same_head)
    rows += q8_quality
    rows.append(
        Row(
            f"greedy tokens of {like} equal to llama.cpp's before the first difference",
            f"{common_prefix(tokens[like], tokens[peer_2])}/{new_tokens}",
            "",
            None,
        )
    )
    return rows


def int8_activation_quality(
    reference, candidate, tokenizer, max_len: int = 256
) -> tuple[float, float, int]:
    """(mean KLD, same top-1, positions) of `candidate` (int8 activations) against
    `reference` (the same weights, float32 activations), teacher-forced over the
    eval slices' first passages (`max_len` tokens each) fed `int4_cpu.MAX_ROWS`
    tokens a chunk: the rows the decode kernel takes, so every int4 matmul of both
    runs it (a longer chunk would run the float reference in both)."""
    from gpuagent.benches.engine import quality_sequences, teacher_forced_logprobs
    from kernels import int4_cpu

    ref, cand = [], []
    for ids in quality_sequences(tokenizer, max_len):
        for model, out in ((reference, ref), (candidate, cand)):
            out.append(teacher_forced_logprobs(model, ids, "bf16", int4_cpu.MAX_ROWS))
    r, c = torch.cat(ref), torch.cat(cand)
    kld = (r.exp() * (r - c)).sum(-1).mean().item()
    top1 = (r.argmax(-1) == c.argmax(-1)).float().mean().item()
    return kld, top1, r.shape[0]


def head_threads_rows(
    folder: Path, threads: int, new_tokens: int, rounds: int
) -> list[Row]:
    """Our decode ms/step with the output head at torch's threads (the default)
    and at the layers' `small_step_threads` (`Transformer.small_step_head`),
    rounds alternating, and whether the greedy tokens are the same."""
    from gpuagent.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    engine = LLMEngine.from_model_dir(
        folder, device="cpu", max_num_seqs=1, kv_memory_bytes=64 << 20
    )
    prompt = engine.encode_prompt(THROUGHPUT_PROMPTS[0])
    best = {False: math.inf, True: math.inf}
    tokens: dict[bool, list[int]] = {}
    for round_ in range(rounds + 1):
        for narrow in (False, True):
            engine.model.small_step_head = narrow
            tokens[narrow], seconds = our_decode(engine, prompt, new_tokens)
            if round_:
                best[narrow] = min(best[narrow], seconds / (new_tokens - 1))
    return [
        Row(
            f"decode ms/step, head at {threads} threads (default) / at the layers'",
            f"{best[False] * 1e3:.1f}/{best[True] * 1e3:.1f}",
            "",
            None,
        ),
        Row(
            "narrow head: speed-up, same greedy tokens",
            f"{best[False] / best[True]:.3f}x {tokens[True] == tokens[False]}",
            "",
            None,
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from gpuagent.models.smollm2 import MODEL_DIR_NAME, gguf_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / MODEL_DIR_NAME)
    parser.add_argument(
        "--folder", type=Path, default=None, help="an existing w4a16 folder to use"
    )
    parser.add_argument(
        "--head-folder",
        type=Path,
        default=None,
        help="an existing w4a16 folder compressed with the recipe's head at the "
        "GGUF's head precision (default: made from --model-dir)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="a prompt of this many tokens of held-out text, so each decode step "
        "attends over that much context (default: a short prompt)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer-dir", type=Path, default=PEER_DIR)
    parser.add_argument(
        "--head-ab",
        action="store_true",
        help="also time our head at torch's threads vs the layers' (ours only)",
    )
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.rounds < 1 or args.threads < 1:
        parser.error("--new-tokens must be >= 2, --rounds and --threads >= 1")
    gguf = gguf_path()
    _, like_head = gguf_head_format(gguf)
    with tempfile.TemporaryDirectory() as tmp:

        def made(head: str | None) -> Path:
            if not (args.model_dir / "config.json").is_file():
                parser.error(f"{args.model_dir} has no model (make real-model)")
            start = time.monotonic()
            out = Path(tmp) / ("w4a16-g128" + (f"-head-{head}" if head else ""))
            folder = w4a16_folder(args.model_dir, out, head)
            print(f"{out.name} folder made in {time.monotonic() - start:.0f} s")
            return folder

        folder = args.folder or made(None)
        head_folder = args.head_folder
        # a GGUF head in a format a recipe writes: the release carries it
        if head_folder is None and like_head in RECIPE_HEAD_FORMATS:
            head_folder = made(like_head)
        rows = decode_rows(
            folder,
            gguf,
            args.threads,
            args.new_tokens,
            args.rounds,
            args.peer_dir,
            head_folder=head_folder,
            prompt_tokens=args.prompt_tokens,
        )
        if args.head_ab:
            rows += head_threads_rows(
                folder, args.threads, args.new_tokens, args.rounds + 2
            )
    failed = False
    for row in rows:
        print(row if isinstance(row, str) else row.render(), flush=True)
        failed |= isinstance(row, Row) and row.ok is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
