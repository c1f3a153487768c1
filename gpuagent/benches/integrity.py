"""Benchmark: `python -m gpuagent.benches.integrity [--size-gb 2]`.

Generates a sharded safetensors model folder under a temp dir (deleted after),
signs it, and in one run measures side by side:

- our `verify_model` vs `model_signing` verify, both default sha256
  (target: ours >= 1.0x as fast);
- plain reading of the files vs our verify with blake3 (target: <= 1.2x the
  read time), warm page cache and cold (pages dropped with posix_fadvise);
- `read_verified_files` (verify-on-load) vs reading the files into memory;
- the % that verify-on-load adds to an engine load of the demo model;
- a re-verify in full (every file re-hashed, what gates do) vs a quick one with
  a digest cache (files unchanged by stat key not read);
- hostile inputs, each in a child process (wall time and peak memory): a
  `--hostile-mb` safetensors header of empty lists, gate vs the safetensors
  library; a config.json of the same; a gzip bomb; verify of a folder with a
  sparse 128 GiB file planted after signing.

Each timing is the median of `--repeats` runs. Torch is imported only for the
engine measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import io
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.integrity.errors import IntegrityError
from gpuagent.integrity.manifest import hash_model
from gpuagent.integrity.policy import Policy, ReleaseBinding
from gpuagent.integrity.signing import sign_model, verify_model
from gpuagent.integrity.verified_load import read_verified_files

RELEASE = ReleaseBinding("bench", "0", "none", "")


def generate_folder(folder: Path, total_bytes: int, shards: int) -> int:
    """Sharded folder of ~total_bytes; returns the exact bytes written."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, size=64 << 20, dtype=np.uint8).tobytes()
    per_shard = (total_bytes // shards) // 2 * 2
    weight_map, written = {}, 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensor = f"model.layers.{i}.weight"
        header = json.dumps(
            {
                tensor: {
                    "dtype": "BF16",
                    "shape": [per_shard // 2],
                    "data_offsets": [0, per_shard],
                }
            }
        ).encode()
        header += b" " * (-len(header) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per_shard
            while left:
                chunk = block[: min(left, len(block))]
                # vary each block so no two shards are byte-identical
                f.write(struct.pack("<Q", left) + chunk[8:])
                left -= len(chunk)
        weight_map[tensor] = name
        written += 8 + len(header) + per_shard
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return written


def wide_json(size_bytes: int) -> bytes:
    """A JSON object of about `size_bytes` holding one list of empty lists
    (`{"a": [[],[],...]}`): a third of a million elements per MB, gigabytes once
    a parser builds them as objects."""
    count = max((size_bytes - 10) // 3, 1)
    return b'{"a": [' + b"[]," * (count - 1) + b"[]]}"


def hostile_safetensors(size_bytes: int) -> bytes:
    """A safetensors file whose header is `wide_json(size_bytes)`."""
    header = wide_json(size_bytes)
    return struct.pack("<Q", len(header)) + header


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def drop_cache(folder: Path) -> None:
    for path in files_of(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(folder: Path) -> None:
    """Reads every file once into a reused buffer, files in parallel threads."""

    def read(path: Path) -> None:
        buf = memoryview(bytearray(8 << 20))
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        list(pool.map(read, files_of(folder)))


def plain_read_bytes(folder: Path) -> dict[str, bytes]:
    """What a loader does without verification: every file into memory."""

    def read(path: Path) -> tuple[str, bytes]:
        with io.FileIO(path) as f:
            return path.relative_to(folder).as_posix(), f.readall()

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return dict(pool.map(read, files_of(folder)))


def hash_in_memory_blake3(blobs: list[bytes]) -> None:
    """blake3 of each blob with all cores (its own threads), nothing read."""
    for blob in blobs:
        blake3.blake3(blob, max_threads=blake3.blake3.AUTO).digest()


def timed(
    fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None
) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_signing_verify(
    folder: Path, signature: Path, public_key: Path, algorithm: str = "sha256"
) -> None:
    from model_signing import hashing, verifying

    config = hashing.Config().use_file_serialization(hashing_algorithm=algorithm)
    verifier = verifying.Config().use_elliptic_key_verifier(public_key=public_key)
    verifier.set_hashing_config(config).verify(folder, signature)


def engine_overhead(repeats: int) -> str:
    if (
        not DEMO_MODEL_DIR.is_dir()
        or importlib.util.find_spec("gpuagent.engine.loader") is None
    ):
        return f"skipped: {DEMO_MODEL_DIR} or the engine loader does not exist yet"
    from gpuagent.engine.loader import load_model  # torch, only here

    digests = {a: hash_model(DEMO_MODEL_DIR, a).digest for a in ("sha256", "blake3")}
    runs: dict[str, Callable[[], object]] = {
        "plain": lambda: load_model(DEMO_MODEL_DIR),
        **{
            a: lambda d=d: load_model(
                DEMO_MODEL_DIR, files=read_verified_files(DEMO_MODEL_DIR, d)
            )
            for a, d in digests.items()
        },
    }
    for run in runs.values():  # warm imports and the page cache
        run()
    # Interleaved, so drift in machine load hits every variant alike.
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    size = sum(p.stat().st_size for p in files_of(DEMO_MODEL_DIR)) / 1e6
    parts = [f"demo model ({size:.1f} MB): load {median['plain'] * 1e3:.1f} ms"]
    for algorithm in digests:
        extra = (median[algorithm] / median["plain"] - 1) * 100
        parts.append(
            f"verify-on-load {algorithm} {median[algorithm] * 1e3:.1f} ms "
            f"({extra:+.1f}%)"
        )
    return "; ".join(parts)


def measure_child(code: str) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of `python -c code` in a child.

    The peak is the child's VmHWM, read by the child itself at exit: its
    rusage ru_maxrss would count the parent's memory at the fork (Linux keeps
    the high-water mark across exec)."""
    wrapped = (
        "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) + "finally:\n"
        "    import sys\n"
        "    status = open('/proc/self/status').read().split('VmHWM:')[1]\n"
        "    print('VmHWM', status.split()[0], file=sys.stderr)\n"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=600
    )
    elapsed = time.perf_counter() - start
    peak_kb = [
        line.split()[1]
        for line in done.stderr.splitlines()
        if line.startswith("VmHWM ")
    ]
    return elapsed, int(peak_kb[-1]) * 1024, done.stdout


_INSPECT = (
    "from gpuagent.integrity import inspect_model, IntegrityError\n"
    "try:\n    inspect_model({folder!r})\nexcept IntegrityError:\n    pass\n"
)
_SAFETENSORS = (
    "from safetensors import safe_open\n"
    "try:\n    safe_open({path!r}, 'np')\nexcept Exception:\n    pass\n"
)


def hostile_rows(root: Path, size_mb: float, signed: tuple[Path, Path, Policy]):
    """(name, seconds, peak bytes) of the gate on hostile inputs, each in a
    child process; the safetensors library on the same header beside it."""
    import gzip

    size = int(size_mb * 1e6)
    rows = []
    header = root / "hostile-header"
    header.mkdir()
    weights = header / "model.safetensors"
    weights.write_bytes(hostile_safetensors(size))
    rows.append(
        (
            f"safetensors library, {size_mb:g} MB header",
            *measure_child(_SAFETENSORS.format(path=str(weights)))[:2],
        )
    )
    rows.append(
        (
            f"gate, {size_mb:g} MB header",
            *measure_child(_INSPECT.format(folder=str(header)))[:2],
        )
    )
    config = root / "hostile-config"
    config.mkdir()
    (config / "config.json").write_bytes(wide_json(size))
    rows.append(
        (
            f"gate, {size_mb:g} MB config.json",
            *measure_child(_INSPECT.format(folder=str(config)))[:2],
        )
    )
    bomb = root / "hostile-bomb"
    bomb.mkdir()
    zeros = 10 * size  # 990 MB at 99: past the default 256 MiB budget
    (bomb / "weights.blob").write_bytes(gzip.compress(b"\0" * zeros, 1))
    rows.append(
        (
            f"gate, gzip bomb ({zeros / 1e6:g} MB of zeros)",
            *measure_child(_INSPECT.format(folder=str(bomb)))[:2],
        )
    )
    folder, signature, policy = signed
    planted = folder / "planted.safetensors"
    with open(planted, "wb") as f:
        f.truncate(128 << 30)
    start = time.perf_counter()
    try:
        verify_model(folder, signature, policy)
    except IntegrityError:
        pass
    rows.append(("verify, sparse 128 GiB planted", time.perf_counter() - start, 0))
    planted.unlink()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.integrity")
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where to create the temp folder")
    parser.add_argument("--no-cold", action="store_true", help="skip cold-cache rows")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine row")
    parser.add_argument(
        "--hostile-mb", type=float, default=99.0, help="size of the hostile headers"
    )
    args = parser.parse_args(argv)

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root = Path(tempfile.mkdtemp(prefix="rg-bench-", dir=args.dir))
    try:
        folder = root / "model"
        size = generate_folder(folder, int(args.size_gb * 1e9), args.shards)
        key = ec.generate_private_key(ec.SECP256R1())
        (root / "key.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        public_pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        (root / "key.pub").write_bytes(public_pem)
        sig_sha, sig_b3 = root / "sha256.sig", root / "blake3.sig"
        signed = sign_model(
            folder, sig_sha, release=RELEASE, private_key=root / "key.pem"
        )
        b3 = sign_model(
            folder,
            sig_b3,
            release=RELEASE,
            private_key=root / "key.pem",
            algorithm="blake3",
        )
        policy = Policy(public_keys_pem=(public_pem,), release=RELEASE)
        plain_read(folder)  # warm the page cache

        r = args.repeats
        rows: list[tuple[str, float]] = []
        t_read = timed(lambda: plain_read(folder), r)
        rows.append(("plain read (warm)", t_read))
        t_ms = timed(lambda: model_signing_verify(folder, sig_sha, root / "key.pub"), r)
        rows.append(("model_signing verify sha256", t_ms))
        t_ours = timed(lambda: verify_model(folder, sig_sha, policy), r)
        rows.append(("ours verify sha256", t_ours))
        t_ms_b3 = timed(
            lambda: model_signing_verify(folder, sig_b3, root / "key.pub", "blake3"), r
        )
        rows.append(("model_signing verify blake3", t_ms_b3))
        t_b3 = timed(lambda: verify_model(folder, sig_b3, policy), r)
        rows.append(("ours verify blake3", t_b3))
        t_bytes = timed(lambda: plain_read_bytes(folder), r)
        rows.append(("plain read into memory", t_bytes))
        # The floor under any blake3 verify: hashing bytes already in memory, every
        # core on it, no reading at all.
        in_memory = list(plain_read_bytes(folder).values())
        t_hash = timed(lambda: hash_in_memory_blake3(in_memory), r)
        in_memory.clear()  # 2 GB back
        rows.append(("blake3 of bytes in memory (no I/O)", t_hash))
        t_load = timed(lambda: read_verified_files(folder, b3.manifest.digest), r)
        rows.append(("read_verified_files blake3", t_load))
        cold: list[tuple[str, float]] = []
        if not args.no_cold:
            drop = lambda: drop_cache(folder)  # noqa: E731
            cold.append(
                ("plain read (cold)", timed(lambda: plain_read(folder), r, drop))
            )
            cold.append(
                (
                    "ours verify blake3 (cold)",
                    timed(lambda: verify_model(folder, sig_b3, policy), r, drop),
                )
            )
        # Re-verify: full (gates) vs quick with a digest cache. The cache keeps
        # no file changed in the last 2 s (racy timestamps): wait that out.
        cache = root / "digests.json"
        time.sleep(
            max(0.0, 2.1 - (time.time() - (folder / "config.json").stat().st_ctime))
        )
        verify_model(folder, sig_sha, policy, digest_cache=cache)  # fills it
        t_full = timed(lambda: verify_model(folder, sig_sha, policy), r)
        t_quick = timed(
            lambda: verify_model(folder, sig_sha, policy, digest_cache=cache), r
        )
        rows.append(("re-verify full sha256 (gates)", t_full))
        rows.append(("re-verify quick (digest cache)", t_quick))
        hostile = hostile_rows(root, args.hostile_mb, (folder, sig_sha, policy))
        del signed

        gb = size / 1e9
        print(
            f"folder: {gb:.2f} GB in {args.shards} shards, {os.cpu_count()} CPUs, "
            f"median of {r}"
        )
        print(f"{'measurement':34} {'time s':>8} {'GB/s':>7}")
        for name, t in rows + cold:
            print(f"{name:34} {t:8.3f} {gb / t:7.2f}")
        print()
        line = "{:35} {:5.2f}x{}".format
        print(line("ours vs model_signing, sha256:", t_ms / t_ours, " (target >= 1.0)"))
        print(line("ours vs model_signing, blake3:", t_ms_b3 / t_b3, ""))
        print(
            line("blake3 verify / plain read, warm:", t_b3 / t_read, " (target <= 1.2)")
        )
        floor = " (floor: hashing alone, no I/O)"
        print(line("  blake3 in memory / plain read:", t_hash / t_read, floor))
        if cold:
            ratio = cold[1][1] / cold[0][1]
            print(line("blake3 verify / plain read, cold:", ratio, " (target <= 1.2)"))
        print(line("read_verified_files / read to mem:", t_load / t_bytes, ""))
        print(line("re-verify full / quick:", t_full / t_quick, ""))
        print()
        print(f"{'hostile input (child process)':38} {'time s':>8} {'peak MB':>8}")
        for name, t, peak in hostile:
            shown = f"{peak / 1e6:8.0f}" if peak else f"{'-':>8}"
            print(f"{name:38} {t:8.2f} {shown}")
        library, gate = hostile[0][1], hostile[1][1]
        print(line("gate / safetensors library, header:", gate / library, ""))
        engine = (
            "skipped (--no-engine)" if args.no_engine else engine_overhead(max(r, 11))
        )
        print(f"verify-on-load, engine: {engine}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
