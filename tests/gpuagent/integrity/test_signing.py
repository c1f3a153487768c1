"""sign_model / verify_model: tamper cases after signing, release binding and
replay, signer trust, ignore-list policy, and library failures turned into our
typed errors."""

import base64
import json
import os
import shutil
from pathlib import Path

import pytest

from gpuagent.integrity import (
    BindingMismatchError,
    FolderLimits,
    IgnoreListError,
    IntegrityError,
    ManifestMismatchError,
    ModelRejectedError,
    PolicyError,
    ReleaseBinding,
    SignatureError,
    SignerNotTrustedError,
    SigningError,
    UnsafePathError,
    sign_model,
    verify_model,
)
from tests.gpuagent.integrity.builders import (
    RELEASE,
    CertificateAuthority,
    ReadFromFile,
    make_sparse,
    mutations,
    refuse_reads,
    shard_under_extras,
    upstream_sign,
    write_model,
)

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def signed(tmp_path, keys):
    folder = write_model(tmp_path / "model", sharded=True)
    sign_model(folder, folder / "model.sig", release=RELEASE, private_key=keys.private)
    return folder


def flip_byte(folder):
    data = bytearray((folder / SHARD1).read_bytes())
    data[-3] ^= 0x01
    (folder / SHARD1).write_bytes(bytes(data))


def truncate(folder):
    with open(folder / SHARD1, "r+b") as f:
        f.truncate(os.path.getsize(folder / SHARD1) - 4)


def append(folder):
    with open(folder / SHARD2, "ab") as f:
        f.write(b"\0")


def swap_shards(folder):
    one, two = (folder / SHARD1).read_bytes(), (folder / SHARD2).read_bytes()
    (folder / SHARD1).write_bytes(two)
    (folder / SHARD2).write_bytes(one)


TAMPERS = [
    ("flipped-byte", flip_byte, [], [], [SHARD1]),
    ("truncated", truncate, [], [], [SHARD1]),
    ("appended-bytes", append, [], [], [SHARD2]),
    (
        "added-file",
        lambda f: (f / "generation_config.json").write_text("{}"),
        [],
        ["generation_config.json"],
        [],
    ),
    (
        "removed-file",
        lambda f: (f / "tokenizer.json").unlink(),
        ["tokenizer.json"],
        [],
        [],
    ),
    (
        "renamed-file",
        lambda f: (f / "tokenizer.json").rename(f / "tokenizer2.json"),
        ["tokenizer.json"],
        ["tokenizer2.json"],
        [],
    ),
    ("swapped-shards", swap_shards, [], [], [SHARD1, SHARD2]),
    ("added-empty-file", lambda f: (f / "x.py").write_bytes(b""), [], ["x.py"], []),
]


def test_it_verifies_an_untouched_signed_folder(signed, keys):
    report = verify_model(signed, signed / "model.sig", keys.policy())

    assert report.ok
    assert report.release["version"] == RELEASE.version
    assert report.signer.startswith("key sha256:")
    assert "model.sig" not in report.files
    assert SHARD1 in report.files


@pytest.mark.parametrize(
    ("name", "tamper", "missing", "extra", "changed"),
    TAMPERS,
    ids=[t[0] for t in TAMPERS],
)
def test_it_lists_exactly_what_was_tampered(
    signed, keys, name, tamper, missing, extra, changed
):
    tamper(signed)

    with pytest.raises(ManifestMismatchError) as info:
        verify_model(signed, signed / "model.sig", keys.policy())

    assert (info.value.missing, info.value.extra, info.value.changed) == (
        missing,
        extra,
        changed,
    )


def test_it_catches_an_empty_file_added_to_a_sharded_manifest(tmp_path, keys):
    folder = write_model(tmp_path / "model", sharded=True)
    sign_model(
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=keys.private,
        shard_size=1 << 20,
    )
    (folder / "planted.json").write_bytes(b"")

    with pytest.raises(ManifestMismatchError) as info:
        verify_model(folder, folder / "model.sig", keys.policy())

    assert info.value.extra == ["planted.json"]


def test_it_refuses_a_symlink_that_replaces_a_file(signed, keys, tmp_path):
    outside = tmp_path / "evil.json"
    outside.write_text((signed / "tokenizer.json").read_text())
    (signed / "tokenizer.json").unlink()
    os.symlink(outside, signed / "tokenizer.json")

    with pytest.raises(UnsafePathError, match="tokenizer.json"):
        verify_model(signed, signed / "model.sig", keys.policy())


def test_it_refuses_a_signature_replayed_for_another_release(signed, keys):
    next_release = ReleaseBinding(RELEASE.model, "1.0.1", RELEASE.recipe, "")

    with pytest.raises(BindingMismatchError) as info:
        verify_model(signed, signed / "model.sig", keys.policy(release=next_release))

    assert info.value.mismatches == {"version": ("1.0.1", "1.0.0")}


@pytest.mark.parametrize("field", ["model", "recipe", "parent_digest"])
def test_it_binds_every_release_field(signed, keys, field):
    other = ReleaseBinding(**{**RELEASE.to_dict(), field: "something-else"})

    with pytest.raises(BindingMismatchError, match=field):
        verify_model(signed, signed / "model.sig", keys.policy(release=other))


def test_it_refuses_a_signature_replayed_onto_another_folder(signed, keys, tmp_path):
    other = write_model(tmp_path / "other", sharded=True, seed=7)
    shutil.copy(signed / "model.sig", other / "model.sig")

    with pytest.raises(ManifestMismatchError) as info:
        verify_model(other, other / "model.sig", keys.policy())

    assert info.value.changed == [SHARD1, SHARD2]


def test_it_refuses_a_signature_by_an_untrusted_key(tmp_path, keys, other_keys):
    folder = write_model(tmp_path / "model")
    sign_model(
        folder, folder / "model.sig", release=RELEASE, private_key=other_keys.private
    )

    with pytest.raises(SignerNotTrustedError, match="does not trust"):
        verify_model(folder, folder / "model.sig", keys.policy())


def test_it_refuses_a_wrong_key_dressed_as_the_trusted_one(tmp_path, keys, other_keys):
    folder = write_model(tmp_path / "model")
    sig = folder / "model.sig"
    sign_model(folder, sig, release=RELEASE, private_key=other_keys.private)
    bundle = json.loads(sig.read_text())
    real_hint = keys.policy().public_keys_pem[0]
    from gpuagent.integrity import key_fingerprint

    bundle["verificationMaterial"]["publicKey"]["hint"] = key_fingerprint(real_hint)
    sig.write_text(json.dumps(bundle))

    with pytest.raises(SignatureError, match="does not verify"):
        verify_model(folder, sig, keys.policy())


def edit_payload(sig: Path, edit) -> None:
    bundle = json.loads(sig.read_text())
    envelope = bundle["dsseEnvelope"]
    statement = json.loads(base64.b64decode(envelope["payload"]))
    edit(statement)
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    sig.write_text(json.dumps(bundle))


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["predicate"]["releasegate"].update(version="9.9.9"),
        lambda s: s["predicate"]["resources"][0].update(digest="00" * 32),
        lambda s: s["predicate"]["serialization"].update(
            ignore_paths=["tokenizer.json"]
        ),
    ],
    ids=["binding", "digest", "ignore-list"],
)
def test_it_refuses_an_edited_payload(signed, keys, edit):
    edit_payload(signed / "model.sig", edit)

    with pytest.raises(SignatureError):
        verify_model(signed, signed / "model.sig", keys.policy())


def test_it_refuses_a_signature_that_ignores_weights(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    sign_model(
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=keys.private,
        ignore_paths=("model.safetensors", "config.json"),
    )

    with pytest.raises(IgnoreListError) as info:
        verify_model(folder, folder / "model.sig", keys.policy())

    assert info.value.paths == ["config.json", "model.safetensors"]


def test_it_requires_the_signature_file_to_be_ignored_explicitly(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    sign_model(
        folder, tmp_path / "outside.sig", release=RELEASE, private_key=keys.private
    )
    shutil.copy(tmp_path / "outside.sig", folder / "model.sig")

    with pytest.raises(IgnoreListError, match="not in the signed ignore list"):
        verify_model(folder, folder / "model.sig", keys.policy())
    # Kept outside the folder, the same signature is fine; the copy inside
    # counts as an unsigned extra file.
    with pytest.raises(ManifestMismatchError, match="extra files: model.sig"):
        verify_model(folder, tmp_path / "outside.sig", keys.policy())
    (folder / "model.sig").unlink()
    assert verify_model(folder, tmp_path / "outside.sig", keys.policy()).ok


@pytest.mark.parametrize(
    ("algorithm", "shard_size", "prefix"),
    [("sha256", 1 << 20, "sha256-sharded-1048576:"), ("blake3", None, "blake3:")],
)
def test_it_signs_and_verifies_other_hash_settings(
    tmp_path, keys, algorithm, shard_size, prefix
):
    folder = write_model(tmp_path / "model", sharded=True)
    result = sign_model(
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=keys.private,
        algorithm=algorithm,
        shard_size=shard_size,
    )

    report = verify_model(folder, folder / "model.sig", keys.policy())

    assert report.manifest_digest == result.manifest.digest
    assert report.manifest_digest.startswith(prefix)


def test_it_refuses_hash_settings_outside_the_policy(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    sign_model(  # a signer under a laxer policy than the verifier's
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=keys.private,
        shard_size=4096,
        policy=keys.policy(min_shard_size=1),
    )

    with pytest.raises(PolicyError, match="shard size"):
        verify_model(folder, folder / "model.sig", keys.policy())
    with pytest.raises(PolicyError, match="hash type"):
        verify_model(
            folder,
            folder / "model.sig",
            keys.policy(allowed_hash_types=frozenset({"blake3"}), min_shard_size=1),
        )


def test_it_verifies_certificate_signatures_and_checks_the_identity(tmp_path):
    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")
    folder = write_model(tmp_path / "model")
    ca.sign(folder)

    report = verify_model(folder, folder / "model.sig", ca.policy())

    assert report.signer == "certificate ci@releasegate.example by releases CA"
    with pytest.raises(SignerNotTrustedError, match="identity"):
        verify_model(
            folder,
            folder / "model.sig",
            ca.policy(certificate_identity="someone@else.example"),
        )
    with pytest.raises(SignerNotTrustedError, match="issuer"):
        verify_model(
            folder, folder / "model.sig", ca.policy(certificate_issuer="Other CA")
        )


def test_it_refuses_a_certificate_from_another_ca(tmp_path):
    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")
    rogue = CertificateAuthority(tmp_path, "rogue", "ci@releasegate.example")
    folder = write_model(tmp_path / "model")
    sign_model(
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=rogue.private,
        certificate=rogue.certificate,
        certificate_chain=(rogue.chain,),
    )

    with pytest.raises(SignatureError):
        verify_model(
            folder, folder / "model.sig", ca.policy(certificate_issuer="rogue CA")
        )


def test_it_refuses_a_key_signature_in_certificate_mode(signed, tmp_path):
    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")

    with pytest.raises(SignatureError, match="not a certificate signature"):
        verify_model(signed, signed / "model.sig", ca.policy())


def sigstore_trust_config(tmp_path: Path) -> Path:
    # The production trusted root shipped inside sigstore-python, pinned to a file.
    import sigstore

    store = (
        Path(sigstore.__file__).parent
        / "_store"
        / "https%3A%2F%2Ftuf-repo-cdn.sigstore.dev"
    )
    config = {
        "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
        "trustedRoot": json.loads((store / "trusted_root.json").read_text()),
        "signingConfig": json.loads((store / "signing_config.v0.2.json").read_text()),
    }
    path = tmp_path / "trust_config.json"
    path.write_text(json.dumps(config))
    return path


def test_it_needs_a_pinned_trust_config_for_sigstore(signed, keys):
    with pytest.raises(PolicyError, match="trust config"):
        verify_model(
            signed, signed / "model.sig", keys.policy(signature_mode="sigstore")
        )


def test_it_turns_a_sigstore_verification_failure_into_our_error(
    signed, keys, tmp_path
):
    # Offline: the pinned trust config loads, and a bundle that is not a valid
    # Sigstore signature is refused with our error, not a library exception.
    policy = keys.policy(
        signature_mode="sigstore",
        sigstore_trust_config=str(sigstore_trust_config(tmp_path)),
        certificate_identity="ci@releasegate.example",
        certificate_issuer="https://token.actions.githubusercontent.com",
    )

    with pytest.raises(SignatureError):
        verify_model(signed, signed / "model.sig", policy)


@pytest.mark.parametrize(
    "content",
    ["", "not json", "{}", '{"mediaType": "x", "verificationMaterial": {}}', "[1, 2]"],
    ids=["empty", "text", "empty-object", "wrong-bundle", "array"],
)
def test_it_turns_garbage_signatures_into_our_error(signed, keys, content):
    (signed / "model.sig").write_text(content)

    with pytest.raises(SignatureError):
        verify_model(signed, signed / "model.sig", keys.policy())


def test_it_refuses_a_missing_signature_and_a_policy_without_keys(signed, keys):
    with pytest.raises(SignatureError, match="does not exist"):
        verify_model(signed, signed / "nope.sig", keys.policy())
    with pytest.raises(PolicyError, match="trusts no public key"):
        verify_model(signed, signed / "model.sig", keys.policy(public_keys_pem=()))


def test_it_turns_signing_failures_into_our_error(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    (tmp_path / "bad.pem").write_text("not a key")

    with pytest.raises(SigningError):
        sign_model(
            folder,
            tmp_path / "m.sig",
            release=RELEASE,
            private_key=tmp_path / "bad.pem",
        )
    with pytest.raises(SigningError):
        sign_model(folder, tmp_path / "m.sig", release=RELEASE)
    with pytest.raises(IntegrityError):
        sign_model(
            tmp_path / "missing",
            tmp_path / "m.sig",
            release=RELEASE,
            private_key=keys.private,
        )


def test_it_refuses_a_certificate_that_does_not_match_the_key(tmp_path, keys):
    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")
    folder = write_model(tmp_path / "model")

    with pytest.raises(SigningError, match="does not match"):
        sign_model(
            folder,
            folder / "model.sig",
            release=RELEASE,
            private_key=keys.private,
            certificate=ca.certificate,
        )


def test_it_refuses_a_validly_signed_statement_with_duplicate_keys(signed, keys):
    # Two parsers could read two different releases out of such a payload.
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from model_signing._signing.sign_sigstore_pb import pae

    sig = signed / "model.sig"
    bundle = json.loads(sig.read_text())
    text = base64.b64decode(bundle["dsseEnvelope"]["payload"]).decode()
    forged = (
        text.rstrip()[:-1]
        + ', "predicateType": "https://model_signing/signature/v1.0"}'
    )
    key = serialization.load_pem_private_key(keys.private.read_bytes(), None)
    signature = key.sign(pae(forged.encode()), ec.ECDSA(hashes.SHA256()))
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(forged.encode()).decode()
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(
        signature
    ).decode()
    sig.write_text(json.dumps(bundle))

    with pytest.raises(SignatureError, match="duplicate"):
        verify_model(signed, sig, keys.policy())


def test_it_lets_the_signature_being_checked_be_ignored_under_any_name(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    sign_model(
        folder, folder / "release-7.sig", release=RELEASE, private_key=keys.private
    )

    assert verify_model(folder, folder / "release-7.sig", keys.policy()).ok
    (folder / "copy.sig").write_bytes((folder / "release-7.sig").read_bytes())
    with pytest.raises(IgnoreListError, match="release-7.sig"):
        verify_model(folder, folder / "copy.sig", keys.policy())


def test_it_never_raises_anything_but_its_own_error_on_mutated_signatures(signed, keys):
    sig = signed / "model.sig"
    for data in mutations(sig.read_bytes(), seed=99, count=60):
        sig.write_bytes(data)
        try:
            verify_model(signed, sig, keys.policy())
        except IntegrityError:
            pass


# --- release binding not required by the policy ------------------------------


def test_it_reports_when_the_policy_did_not_check_the_binding(signed, keys):
    checked = verify_model(signed, signed / "model.sig", keys.policy())
    unchecked = verify_model(signed, signed / "model.sig", keys.policy(release=None))

    assert checked.binding_checked is True
    assert "NOT CHECKED" not in checked.to_text()
    # Programmatic opt-out: accepted, but the report says the binding was not
    # compared with any release.
    assert unchecked.ok and unchecked.binding_checked is False
    assert unchecked.to_dict()["binding_checked"] is False
    assert "NOT CHECKED" in unchecked.to_text()


# --- password-protected keys -------------------------------------------------


def encrypted_key(tmp_path: Path, password: bytes) -> tuple[Path, bytes]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "encrypted.pem"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(password),
        )
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return path, public


def test_it_signs_with_a_password_protected_key(tmp_path, keys):
    private, public = encrypted_key(tmp_path, "pässword".encode())
    folder = write_model(tmp_path / "model")

    sign_model(
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=private,
        password="pässword",
    )

    report = verify_model(
        folder, folder / "model.sig", keys.policy(public_keys_pem=(public,))
    )
    assert report.ok and report.release["version"] == RELEASE.version


def test_it_names_a_bad_or_missing_password(tmp_path, keys):
    private, _ = encrypted_key(tmp_path, b"right")
    folder = write_model(tmp_path / "model")

    def sign(key, password, **extra):
        sign_model(
            folder,
            tmp_path / "m.sig",
            release=RELEASE,
            private_key=key,
            password=password,
            **extra,
        )

    with pytest.raises(SigningError, match="bad password"):
        sign(private, "wrong")
    with pytest.raises(SigningError, match="encrypted: give its password"):
        sign(private, None)
    with pytest.raises(SigningError, match="not encrypted"):
        sign(keys.private, "right")
    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")
    with pytest.raises(SigningError, match="certificate signing needs"):
        sign(private, "right", certificate=ca.certificate)
    assert not (tmp_path / "m.sig").exists()


# --- certificate validity ----------------------------------------------------


def test_it_reports_the_signing_certificate_validity_window(tmp_path):
    from cryptography import x509

    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")
    folder = write_model(tmp_path / "model")
    ca.sign(folder)

    report = verify_model(folder, folder / "model.sig", ca.policy())

    leaf = x509.load_pem_x509_certificate(ca.certificate.read_bytes())
    assert report.certificate_validity == {
        "not_before": leaf.not_valid_before_utc.isoformat(),
        "not_after": leaf.not_valid_after_utc.isoformat(),
        "expired": False,
    }
    assert f"valid {leaf.not_valid_before_utc.isoformat()} to" in report.to_text()
    assert "expired" not in report.to_text()


def test_it_reports_no_certificate_validity_for_key_signatures(signed, keys):
    report = verify_model(signed, signed / "model.sig", keys.policy())

    assert report.certificate_validity is None
    assert "certificate:" not in report.to_text()


def test_it_refuses_a_certificate_signature_whose_certificate_has_expired(tmp_path):
    # No trusted signing time in certificate mode: an expired leaf could sign today.
    from cryptography import x509

    ca = CertificateAuthority(tmp_path, "old", "ci@x.example", leaf_days=(-10, -1))
    folder = write_model(tmp_path / "model")
    ca.sign(folder)
    leaf = x509.load_pem_x509_certificate(ca.certificate.read_bytes())

    with pytest.raises(SignerNotTrustedError, match="expired"):
        verify_model(folder, folder / "model.sig", ca.policy())
    report = verify_model(
        folder, folder / "model.sig", ca.policy(allow_expired_certificates=True)
    )

    assert report.ok
    assert report.certificate_validity["expired"] is True
    assert report.certificate_validity["not_after"] == (
        leaf.not_valid_after_utc.isoformat()
    )
    assert "(expired now)" in report.to_text()


# --- the listing before any hashing ---------------------------------------------


@pytest.fixture
def no_hashing(monkeypatch):
    """Fails the test if verify reads any file to hash it."""
    from gpuagent.integrity import manifest

    def refuse(*args, **kwargs):
        raise AssertionError("verify hashed a file")

    monkeypatch.setattr(manifest, "_hash_range", refuse)


def test_it_names_a_sparse_128_gib_planted_file_without_reading_it(
    signed, keys, no_hashing
):
    with open(signed / "planted.safetensors", "wb") as f:
        f.truncate(128 << 30)

    with pytest.raises(ManifestMismatchError) as caught:
        verify_model(signed, signed / "model.sig", keys.policy())

    assert caught.value.extra == ["planted.safetensors"]


@pytest.mark.parametrize("shard_size", [None, 1 << 20], ids=["files", "shards"])
def test_it_names_a_signed_file_grown_to_128_gib_without_reading_it(
    tmp_path, keys, shard_size, monkeypatch
):
    folder = write_model(tmp_path / "model")
    sign_model(
        folder,
        folder / "model.sig",
        release=RELEASE,
        private_key=keys.private,
        shard_size=shard_size,
    )
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(128 << 30)
    from gpuagent.integrity import manifest

    monkeypatch.setattr(manifest, "_hash_range", pytest.fail)

    with pytest.raises(ManifestMismatchError) as caught:
        verify_model(folder, folder / "model.sig", keys.policy())

    assert caught.value.changed == ["model.safetensors"]


# --- sign refuses what verify would -------------------------------------------


def test_it_refuses_at_sign_time_a_shard_size_verify_would_refuse(tmp_path, keys):
    folder = write_model(tmp_path / "model")

    with pytest.raises(PolicyError, match="shard size 4096 below policy minimum"):
        sign_model(
            folder,
            folder / "model.sig",
            release=RELEASE,
            private_key=keys.private,
            shard_size=4096,
        )
    assert not (folder / "model.sig").exists()


def test_it_refuses_at_sign_time_an_empty_file_shards_cannot_cover(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    (folder / "added_tokens.json").write_text("")
    sign = dict(release=RELEASE, private_key=keys.private)

    with pytest.raises(PolicyError, match="added_tokens.json"):
        sign_model(folder, folder / "model.sig", shard_size=1 << 20, **sign)
    # Whole-file digests cover an empty file: that signature verifies.
    sign_model(folder, folder / "model.sig", **sign)
    assert verify_model(folder, folder / "model.sig", keys.policy()).ok


def test_it_refuses_a_sign_command_whose_signature_verify_would_refuse(
    tmp_path, keys, capsys
):
    from gpuagent.integrity.__main__ import EXIT_REJECTED, main

    folder = write_model(tmp_path / "model")
    args = ["sign", str(folder), "--signature", str(folder / "model.sig")]
    args += ["--private-key", str(keys.private), "--model", RELEASE.model]
    args += ["--version", RELEASE.version, "--recipe", RELEASE.recipe]

    assert main([*args, "--shard-size", "4096", "--json"]) == EXIT_REJECTED
    assert json.loads(capsys.readouterr().out)["error"] == "policy-violation"


# --- the signature file is bounded --------------------------------------------------


def test_it_refuses_an_oversized_signature_file_before_reading_it(
    signed, keys, tmp_path, monkeypatch
):
    from model_signing._signing import sign_sigstore_pb

    huge = tmp_path / "huge.sig"
    make_sparse(huge, 2 << 30)  # took 4.3 GB of memory to refuse
    refuse_reads(monkeypatch, huge)

    def parsed(*args, **kwargs):
        raise ReadFromFile("model-signing parsed it")

    monkeypatch.setattr(sign_sigstore_pb.Signature, "read", parsed)

    with pytest.raises(SignatureError, match=f"{2 << 30} bytes, more than the limit"):
        verify_model(signed, huge, keys.policy())


def test_it_refuses_to_sign_what_verify_would_not_read(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    policy = keys.policy(limits=FolderLimits(max_signature_bytes=1000))

    with pytest.raises(PolicyError, match="more than verify reads"):
        sign_model(
            folder,
            folder / "model.sig",
            release=RELEASE,
            private_key=keys.private,
            policy=policy,
        )
    assert not (folder / "model.sig").exists()


# --- indexes: what they name must be what was signed -----------------------------


def index_outside(tmp_path: Path) -> Path:
    """A folder whose pytorch_model.bin.index.json maps a tensor to a file
    beside the folder: transformers would load it from there."""
    folder = write_model(tmp_path / "model")
    (tmp_path / "evil.safetensors").write_bytes(
        (folder / "model.safetensors").read_bytes()
    )
    weight_map = {"lm_head.weight": "../evil.safetensors"}
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    return folder


def test_it_refuses_to_sign_an_index_that_points_outside_the_folder(tmp_path, keys):
    folder = index_outside(tmp_path)

    with pytest.raises(ModelRejectedError) as caught:
        sign_model(
            folder, folder / "model.sig", release=RELEASE, private_key=keys.private
        )

    assert caught.value.report.codes() == {"index-path-traversal"}
    assert "pytorch_model.bin.index.json: [index-path-traversal] shard " in str(
        caught.value
    )
    assert "'../evil.safetensors'" in str(caught.value)
    assert not (folder / "model.sig").exists()


def test_it_refuses_a_publishers_signature_over_an_index_that_points_outside(
    tmp_path, keys
):
    folder = index_outside(tmp_path)
    signature = tmp_path / "publisher.sig"
    upstream_sign(folder, signature, keys.private)

    with pytest.raises(ModelRejectedError) as caught:
        verify_model(folder, signature, keys.policy(release=None))

    assert caught.value.report.codes() == {"index-path-traversal"}


def test_it_refuses_a_signature_that_leaves_out_a_shard_an_index_names(tmp_path, keys):
    # A publisher left extras/ out of the manifest; the index loads from it.
    folder = write_model(tmp_path / "model", sharded=True)
    left_out = shard_under_extras(folder)
    signature = tmp_path / "publisher.sig"
    upstream_sign(folder, signature, keys.private, ignore=["extras"])
    policy = keys.policy(release=None, extra_ignorable_paths=("extras",))

    with pytest.raises(ModelRejectedError) as caught:
        verify_model(folder, signature, policy)

    assert caught.value.report.codes() == {"index-shard-not-signed"}
    assert left_out in str(caught.value)
