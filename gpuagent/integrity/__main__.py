"""`python -m gpuagent.integrity inspect|hash|sign|verify ...`

    sign FOLDER --signature S --private-key K --model M --version V --recipe R
    verify FOLDER --signature S --public-key P --model M --version V --recipe R

`verify` checks that the signature is bound to the release named by `--model`,
`--version` and `--recipe` (and `--parent-digest`), so a signature made for one
release (e.g. a revoked one) cannot be replayed for another. Those flags are
required; `--any-release` skips that check explicitly (for signatures made by
other tools, which carry no binding), and the report then says the binding was
not checked.

Exit codes: 0 accepted, 1 rejected (any integrity failure), 2 bad usage
(argparse, missing release flags, or a key/file argument that cannot be read).
Reports go to stdout (one JSON object with `--json`); anything the underlying
libraries print while signing or verifying goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from gpuagent.integrity._text import printable_lines
from gpuagent.integrity.errors import IntegrityError, ModelRejectedError, PolicyError
from gpuagent.integrity.inspection import inspect_model
from gpuagent.integrity.manifest import hash_model
from gpuagent.integrity.policy import (
    DEFAULT_POLICY,
    ReleaseBinding,
    policy_from_trust_args,
    release_from_flags,
)
from gpuagent.integrity.signing import sign_model, verify_model

EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, with bad usage raised as UsageError (so `--json` still gets a
    JSON result) instead of printed and exited."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m gpuagent.integrity")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("folder", type=Path, help="model folder")
        p.add_argument("--json", action="store_true", help="print a JSON report")

    p = sub.add_parser("inspect", help="structural checks of a model folder")
    common(p)
    p.add_argument(
        "--scan-nonfinite", action="store_true", help="also scan weights for NaN/Inf"
    )

    def hashing(p: argparse.ArgumentParser) -> None:
        p.add_argument("--algorithm", choices=("sha256", "blake3"), default="sha256")
        p.add_argument(
            "--shard-size",
            type=int,
            default=None,
            help="hash sha256 in shards of N bytes",
        )
        p.add_argument(
            "--ignore",
            action="append",
            default=[],
            help="path to leave out (repeatable)",
        )

    p = sub.add_parser("hash", help="manifest of file digests")
    common(p)
    hashing(p)
    p.add_argument("--output", type=Path, help="write the manifest JSON here")

    def release(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument("--model", required=required)
        p.add_argument("--version", required=required)
        p.add_argument("--recipe", required=required)
        p.add_argument("--parent-digest", default="")

    p = sub.add_parser("sign", help="sign the manifest, bound to a release")
    common(p)
    hashing(p)
    release(p, True)
    p.add_argument("--signature", type=Path, required=True)
    p.add_argument("--private-key", type=Path, help="ECDSA PEM (key/certificate mode)")
    p.add_argument("--sigstore-token", help="OIDC identity token: Sigstore keyless")
    p.add_argument("--sigstore-trust-config", type=Path, help="pinned trust config")
    p.add_argument("--password")
    p.add_argument("--certificate", type=Path)
    p.add_argument("--certificate-chain", type=Path, action="append", default=[])

    p = sub.add_parser("verify", help="verify a folder against its signature")
    common(p)
    release(p, False)
    p.add_argument(
        "--any-release",
        action="store_true",
        help="do not check which release the signature is bound to (instead of "
        "--model/--version/--recipe). This SKIPS the replay protection: a "
        "signature made for any other release of these files, e.g. a revoked "
        "one, verifies too",
    )
    p.add_argument("--signature", type=Path, required=True)
    p.add_argument(
        "--public-key",
        type=Path,
        action="append",
        default=[],
        help="trusted key (repeatable)",
    )
    p.add_argument(
        "--certificate-chain", type=Path, help="pinned chain (certificate mode)"
    )
    p.add_argument(
        "--sigstore-trust-config", type=Path, help="pinned trust config (sigstore mode)"
    )
    p.add_argument("--identity", help="certificate / sigstore identity")
    p.add_argument("--issuer", help="certificate issuer / OIDC issuer")
    p.add_argument("--manifest-digest", help="also require this manifest digest")
    p.add_argument(
        "--digest-cache",
        type=Path,
        help="quick check: reuse the digests of files unchanged since they were "
        "hashed (by device, inode, size, mtime, ctime), kept in this file (outside "
        "the model folder). Without it every file is re-hashed, as gates do",
    )
    p.add_argument(
        "--allow-ignore",
        action="append",
        default=[],
        help="extra path the signature may leave out",
    )
    return parser


_RELEASE_FLAGS = (
    ("--model", "model"),
    ("--version", "version"),
    ("--recipe", "recipe"),
)


def _verify_release(args: argparse.Namespace) -> ReleaseBinding | None:
    """The release `verify` must check; None only with an explicit --any-release."""
    if args.any_release:
        given = [f for f, attr in _RELEASE_FLAGS if getattr(args, attr) is not None]
        given += ["--parent-digest"] if args.parent_digest else []
        if given:
            raise UsageError(
                "--any-release skips the release check: do not combine it with "
                + ", ".join(given)
            )
        return None
    missing = [flag for flag, attr in _RELEASE_FLAGS if getattr(args, attr) is None]
    if missing:
        raise UsageError(
            f"verify needs the release the signature must be bound to: missing "
            f"{', '.join(missing)} (or pass --any-release to skip the replay "
            "protection)"
        )
    return _release(args)


def _release(args: argparse.Namespace) -> ReleaseBinding | None:
    try:
        return release_from_flags(
            args.model, args.version, args.recipe, args.parent_digest
        )
    except ValueError:
        raise UsageError("--model, --version and --recipe go together") from None


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if not args.folder.is_dir():
        raise UsageError(f"{args.folder} is not a folder")
    if args.command == "inspect":
        report = inspect_model(
            args.folder, DEFAULT_POLICY.replace(scan_nonfinite=args.scan_nonfinite)
        )
        return report.to_dict(), report.to_text()
    if args.command == "hash":
        manifest = hash_model(
            args.folder,
            args.algorithm,
            shard_size=args.shard_size,
            ignore_paths=tuple(args.ignore),
        )
        data = manifest.to_dict()
        if args.output:
            try:
                args.output.write_text(json.dumps(data, indent=2) + "\n")
            except OSError as e:
                raise UsageError(f"cannot write {args.output}: {e}") from e
        text = f"{manifest.digest}  {args.folder} ({len(manifest.files())} files)"
        return data, text
    if args.command == "sign":
        if not args.sigstore_token and not (
            args.private_key and args.private_key.is_file()
        ):
            raise UsageError("give a readable --private-key, or --sigstore-token")
        result = sign_model(
            args.folder,
            args.signature,
            release=_release(args),
            private_key=args.private_key,
            password=args.password,
            certificate=args.certificate,
            certificate_chain=tuple(args.certificate_chain),
            sigstore_identity_token=args.sigstore_token,
            sigstore_trust_config=args.sigstore_trust_config,
            algorithm=args.algorithm,
            shard_size=args.shard_size,
            ignore_paths=tuple(args.ignore),
        )
        return (
            result.to_dict(),
            f"signed {args.folder} -> {args.signature}\n"
            f"  manifest digest: {result.manifest.digest}",
        )
    # verify
    release = _verify_release(args)
    try:
        policy = policy_from_trust_args(
            args, release=release, extra_ignorable_paths=args.allow_ignore
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    report = verify_model(
        args.folder, args.signature, policy, digest_cache=args.digest_cache
    )
    if args.manifest_digest and args.manifest_digest != report.manifest_digest:
        from gpuagent.integrity.errors import ManifestDigestMismatchError

        raise ManifestDigestMismatchError(args.manifest_digest, report.manifest_digest)
    text = report.to_text()
    if policy.release is None:
        text += (
            "\n  WARNING: release binding NOT checked (--any-release): a signature "
            "made for another release of these files would verify too"
        )
    return report.to_dict(), text


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code. Every outcome, a crash included,
    ends in a report: one JSON object on stdout with `--json`."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:
        return _usage(argparse.Namespace(json="--json" in argv), e)
    try:
        # model-signing prints warnings to stdout; keep stdout for our report
        # (a --json report must parse).
        with contextlib.redirect_stdout(sys.stderr):
            data, text = _run(args)
    except UsageError as e:
        return _usage(args, e)
    except ModelRejectedError as e:
        if args.json:
            print(json.dumps({"ok": False, **e.to_dict()}, indent=2))
        else:
            print(e.report.to_text())
        return EXIT_REJECTED
    except PolicyError as e:
        _print_error(args, e)
        return EXIT_REJECTED
    except IntegrityError as e:
        _print_error(args, e)
        return EXIT_REJECTED
    except MemoryError:
        # Fail closed with a report, never a traceback: the gate's parsers are
        # bounded, so this is a bug or a machine short of memory.
        _print_error(args, InternalError("out of memory while checking the folder"))
        return EXIT_REJECTED
    except Exception as e:  # noqa: BLE001 - a crash is a rejection, with a report
        _print_error(args, InternalError(f"internal error: {type(e).__name__}: {e}"))
        return EXIT_REJECTED
    if args.json:
        print(json.dumps({"ok": True, **data}, indent=2))
    else:
        print(text)
    return EXIT_OK


class InternalError(IntegrityError):
    """The gate itself failed: the folder is refused (fail closed)."""

    code = "internal-error"


def _usage(args: argparse.Namespace, error: UsageError) -> int:
    if args.json:
        message = printable_lines(str(error))
        print(json.dumps({"ok": False, "error": "usage", "message": message}))
    print(f"error: {printable_lines(str(error))}", file=sys.stderr)
    return EXIT_USAGE


def _print_error(args: argparse.Namespace, error: IntegrityError) -> None:
    if args.json:
        print(json.dumps({"ok": False, **error.to_dict()}, indent=2))
    else:
        print(f"REJECTED [{error.code}] {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
