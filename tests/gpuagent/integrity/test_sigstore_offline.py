"""Sigstore keyless verification, end to end and offline.

A private Sigstore instance (our Fulcio-like CA, CT log and Rekor-like log, see
`private_sigstore.py`) signs the statement `sign_model` would sign; the trust
config pins exactly its keys. `verify_model` and `read_verified_files` then run
the production path unmodified (model-signing's `sign_sigstore.Verifier` over
sigstore's `Verifier.verify_dsse`): a valid signature is accepted, and each
broken piece is refused with our error, for the reason the piece was broken.
"""

import base64
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from gpuagent.integrity import (
    BindingMismatchError,
    IntegrityError,
    ManifestMismatchError,
    Policy,
    ReleaseBinding,
    SignatureError,
    SignerNotTrustedError,
    hash_model,
    read_verified_files,
    sign_model,
    verify_model,
)
from gpuagent.integrity.signing import _payload, file_sizes
from tests.gpuagent.integrity.builders import RELEASE, mutations, write_model
from tests.gpuagent.integrity.private_sigstore import (
    Authority,
    PrivateSigstore,
    new_key,
)

IDENTITY = (
    "https://github.com/acme/models/.github/workflows/release.yml@refs/heads/main"
)
ISSUER = "https://token.actions.githubusercontent.com"
SHARD1 = "model-00001-of-00002.safetensors"


def statement(folder: Path, release: ReleaseBinding = RELEASE) -> bytes:
    """The DSSE payload `sign_model(folder, folder / "model.sig", ...)` signs:
    the same manifest (signature ignored) and predicate, serialized as
    model-signing's signers do."""
    manifest = hash_model(folder, ignore_paths=("model.sig",))
    payload = _payload(manifest, release, file_sizes(folder, manifest))
    return json_format.MessageToJson(payload.statement.pb).encode()


@pytest.fixture
def sigstore(tmp_path) -> PrivateSigstore:
    return PrivateSigstore(tmp_path)


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_model(tmp_path / "model", sharded=True)


def sign(sigstore, folder, *, release=RELEASE, identity=IDENTITY, **knobs) -> Path:
    bundle = sigstore.sign_bundle(statement(folder, release), identity, ISSUER, **knobs)
    path = folder / "model.sig"
    path.write_text(bundle)
    return path


def policy(sigstore, **changes) -> Policy:
    settings = {
        "signature_mode": "sigstore",
        "certificate_identity": IDENTITY,
        "certificate_issuer": ISSUER,
        "release": RELEASE,
        **changes,
    }
    if "sigstore_trust_config" not in settings:  # setdefault would rewrite it
        settings["sigstore_trust_config"] = str(sigstore.trust_config())
    return Policy(**settings)


def edit_bundle(path: Path, change) -> None:
    bundle = json.loads(path.read_text())
    change(bundle)
    path.write_text(json.dumps(bundle))


def tlog_entry(bundle) -> dict:
    return bundle["verificationMaterial"]["tlogEntries"][0]


# --- accepted ----------------------------------------------------------------


def test_the_signed_statement_is_the_one_sign_model_makes(folder, keys):
    sign_model(folder, folder / "model.sig", release=RELEASE, private_key=keys.private)
    bundle = json.loads((folder / "model.sig").read_text())

    assert base64.b64decode(bundle["dsseEnvelope"]["payload"]) == statement(folder)


def test_it_verifies_a_valid_keyless_signature(sigstore, folder):
    signature = sign(sigstore, folder)
    expected = hash_model(folder, ignore_paths=("model.sig",))

    report = verify_model(folder, signature, policy(sigstore))

    assert report.ok
    assert report.signer == f"sigstore {IDENTITY} by {ISSUER}"
    assert report.manifest_digest == expected.digest
    assert report.root_digest == expected.root_digest
    assert report.release == {
        "format": "releasegate-binding/v1",
        **RELEASE.to_dict(),
        "manifest_digest": expected.digest,
        "file_sizes": json.dumps(file_sizes(folder, expected), separators=(",", ":")),
    }
    assert report.files == sorted(expected.files())
    assert "model.sig" not in report.files


def test_it_loads_the_verified_bytes_of_a_keyless_signed_folder(sigstore, folder):
    signature = sign(sigstore, folder)
    digest = hash_model(folder, ignore_paths=("model.sig",)).digest

    files = read_verified_files(
        folder, digest, signature_path=signature, policy=policy(sigstore)
    )

    on_disk = {
        p.name: p.read_bytes() for p in folder.iterdir() if p.name != "model.sig"
    }
    assert files == on_disk


# --- refused: the signer -------------------------------------------------------


def test_it_refuses_another_identity(sigstore, folder):
    # A valid signature by someone else, and ours under a policy expecting them.
    fork = "https://github.com/evil/fork/.github/workflows/release.yml@refs/heads/main"
    theirs = sign(sigstore, folder, identity=fork)
    with pytest.raises(SignerNotTrustedError, match="SANs do not match"):
        verify_model(folder, theirs, policy(sigstore))

    ours = sign(sigstore, folder)
    with pytest.raises(SignerNotTrustedError, match="SANs do not match"):
        verify_model(folder, ours, policy(sigstore, certificate_identity=fork))


def test_it_refuses_another_oidc_issuer(sigstore, folder):
    signature = sign(sigstore, folder)

    with pytest.raises(SignerNotTrustedError, match="OIDCIssuer does not match"):
        verify_model(
            folder,
            signature,
            policy(sigstore, certificate_issuer="https://evil.example"),
        )


def test_it_refuses_a_certificate_from_a_ca_not_in_the_trust_config(sigstore, folder):
    signature = sign(sigstore, folder, ca=Authority("rogue", sigstore.now))

    with pytest.raises(SignatureError, match="certificate chain") as refused:
        verify_model(folder, signature, policy(sigstore))
    # The right identity from the wrong CA: not a question of who, but of trust.
    assert refused.type is SignatureError


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [
        ({"sct": False}, "does not contain a signed certificate timestamp"),
        ({"ct_key": new_key()}, "SCT verify failed"),
    ],
    ids=["missing-sct", "sct-from-untrusted-ct-log"],
)
def test_it_refuses_a_certificate_without_a_trusted_sct(
    sigstore, folder, knobs, reason
):
    signature = sign(sigstore, folder, **knobs)

    with pytest.raises(SignatureError, match=reason):
        verify_model(folder, signature, policy(sigstore))


# --- refused: the transparency log ---------------------------------------------


def test_it_refuses_an_entry_in_an_untrusted_log(sigstore, folder):
    signature = sign(sigstore, folder, log_key=new_key())

    with pytest.raises(SignatureError, match="checkpoint: invalid signature"):
        verify_model(folder, signature, policy(sigstore))


def rename_checkpoint_origin(bundle):
    proof = tlog_entry(bundle)["inclusionProof"]
    proof["checkpoint"]["envelope"] = proof["checkpoint"]["envelope"].replace(
        " - 1\n", " - 2\n", 1
    )


def move_integrated_time(bundle):
    entry = tlog_entry(bundle)
    entry["integratedTime"] = str(int(entry["integratedTime"]) - 30)


def swap_proof_hash(bundle):
    hashes = tlog_entry(bundle)["inclusionProof"]["hashes"]
    hashes[0], hashes[1] = hashes[1], hashes[0]


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (rename_checkpoint_origin, "checkpoint: invalid signature"),
        (move_integrated_time, "SET: invalid inclusion promise"),
        (swap_proof_hash, "inclusion proof contains invalid root hash"),
    ],
    ids=["checkpoint-edited", "integrated-time-moved", "inclusion-proof-edited"],
)
def test_it_refuses_a_tampered_log_entry(sigstore, folder, tamper, reason):
    signature = sign(sigstore, folder)
    edit_bundle(signature, tamper)

    with pytest.raises(SignatureError, match=reason):
        verify_model(folder, signature, policy(sigstore))


def test_it_refuses_a_log_entry_for_another_statement(sigstore, folder):
    # The log vouches for a statement that is not the one in the envelope.
    other = ReleaseBinding(RELEASE.model, "0.9.0", RELEASE.recipe)
    signature = sign(sigstore, folder, logged_payload=statement(folder, other))

    with pytest.raises(SignatureError, match="payload hash does not match"):
        verify_model(folder, signature, policy(sigstore))


# --- refused: what was signed ---------------------------------------------------


def test_it_refuses_a_payload_edited_after_signing(sigstore, folder):
    signature = sign(sigstore, folder)

    def bump_version(bundle):
        envelope = bundle["dsseEnvelope"]
        text = base64.b64decode(envelope["payload"]).decode()
        assert f'"version": "{RELEASE.version}"' in text
        edited = text.replace(f'"version": "{RELEASE.version}"', '"version": "9.9.9"')
        envelope["payload"] = base64.b64encode(edited.encode()).decode()

    edit_bundle(signature, bump_version)

    with pytest.raises(SignatureError, match="DSSE: invalid signature"):
        verify_model(folder, signature, policy(sigstore))


def test_it_lists_a_model_file_changed_after_signing(sigstore, folder):
    signature = sign(sigstore, folder)
    data = bytearray((folder / SHARD1).read_bytes())
    data[-3] ^= 0x01
    (folder / SHARD1).write_bytes(bytes(data))

    with pytest.raises(ManifestMismatchError) as info:
        verify_model(folder, signature, policy(sigstore))

    assert (info.value.missing, info.value.extra, info.value.changed) == (
        [],
        [],
        [SHARD1],
    )


def test_it_refuses_a_valid_signature_for_another_release(sigstore, folder):
    other = ReleaseBinding(RELEASE.model, "0.9.0", RELEASE.recipe)
    signature = sign(sigstore, folder, release=other)

    with pytest.raises(BindingMismatchError) as info:
        verify_model(folder, signature, policy(sigstore))

    assert info.value.mismatches == {"version": (RELEASE.version, other.version)}


# --- refused: the trust config ---------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [None, "", "not json", "{}", "[1]", "wrong-root-type"],
    ids=["missing", "empty", "text", "empty-object", "array", "wrong-root-type"],
)
def test_it_turns_a_bad_trust_config_into_our_error(sigstore, folder, content):
    signature = sign(sigstore, folder)
    path = sigstore.trust_config()
    if content is None:
        path.unlink()
    elif content == "wrong-root-type":
        config = json.loads(path.read_text())
        config["trustedRoot"]["mediaType"] = "application/x-unknown"
        path.write_text(json.dumps(config))
    else:
        path.write_text(content)

    with pytest.raises(SignatureError):
        verify_model(
            folder, signature, policy(sigstore, sigstore_trust_config=str(path))
        )


def test_it_refuses_a_signature_from_another_sigstore_instance(
    sigstore, folder, tmp_path
):
    signature = sign(PrivateSigstore(tmp_path, "elsewhere"), folder)

    with pytest.raises(SignatureError, match="certificate chain"):
        verify_model(folder, signature, policy(sigstore))


def test_it_never_raises_anything_but_its_own_error_on_mutated_bundles(
    sigstore, folder
):
    signature = sign(sigstore, folder)
    trusted = policy(sigstore)
    refused = 0
    for data in mutations(signature.read_bytes(), seed=1234, count=100):
        signature.write_bytes(data)
        try:
            verify_model(folder, signature, trusted)
        except IntegrityError:
            refused += 1
    # A few bytes are not covered by any signature (JSON layout, the checkpoint
    # signer's name): most mutations must still be refused.
    assert refused > 90
