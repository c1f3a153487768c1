"""A private Sigstore instance for offline tests: real keys, real signatures.

It plays the three public-good services a keyless signature relies on:

- Fulcio: a CA that issues a short-lived code-signing certificate binding an
  ephemeral key to an OIDC identity (SAN) and issuer (Fulcio's OID extension);
- a certificate-transparency log: its key signs the SCT embedded in that
  certificate (RFC 6962 precertificate entry);
- Rekor v1: a Merkle log holding a `dsse` 0.0.1 entry for the signature, with an
  inclusion proof, a signed checkpoint (signed-note format) and an inclusion
  promise (the Signed Entry Timestamp, which also gives the verified time).

`trust_config()` pins exactly these keys in a ClientTrustConfig, and
`sign_bundle()` builds a v0.3 bundle that sigstore's own verifier checks
unmodified. Nothing is ever contacted: the URLs are 127.0.0.1 placeholders.
Knobs on `sign_bundle()` swap one piece for an untrusted one, for the tests
that must be refused.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import struct
from pathlib import Path

import rfc8785
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier
from model_signing._signing.sign_sigstore_pb import pae

IN_TOTO = "application/vnd.in-toto+json"
TRUSTED_ROOT = "application/vnd.dev.sigstore.trustedroot+json;version=0.1"
OIDC_ISSUER = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")  # raw bytes (legacy)
OIDC_ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")  # DER UTF8String
SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")  # embedded SCTs
_ECDSA = ec.ECDSA(hashes.SHA256())
DER, PEM = serialization.Encoding.DER, serialization.Encoding.PEM


UTF8_STRING, OCTET_STRING = 0x0C, 0x04  # DER tags


def der_value(tag: int, content: bytes) -> bytes:
    """One DER TLV (the UTF8String and OCTET STRING extension values below)."""
    n = len(content)
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")  # minimal, as DER wants
    length = bytes([n]) if n < 0x80 else bytes([0x80 | len(size)]) + size
    return bytes([tag]) + length + content


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def der(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> bytes:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return public.public_bytes(DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def sha256(data: bytes) -> dict[str, str]:
    return {"algorithm": "sha256", "value": hashlib.sha256(data).hexdigest()}


def key_id(key) -> bytes:
    """RFC 6962 log id: SHA-256 of the DER SubjectPublicKeyInfo. Sigstore uses it
    for the CT log id in the SCT, the Rekor logId and the checkpoint key hint."""
    return hashlib.sha256(der(key)).digest()


def key_usage(*names: str) -> x509.KeyUsage:
    """A KeyUsage with only `names` set."""
    fields = "digital_signature content_commitment key_encipherment data_encipherment"
    fields += " key_agreement key_cert_sign crl_sign encipher_only decipher_only"
    return x509.KeyUsage(**{f: f in names for f in fields.split()})


class Authority:
    """A self-signed Fulcio-like root (the chain `_verify_chain_at_time` builds:
    webpki CA profile, so critical BasicConstraints, keyCertSign, SKI)."""

    def __init__(self, name: str, now: datetime.datetime):
        self.key = new_key()
        self.name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
                x509.NameAttribute(NameOID.COMMON_NAME, f"{name} fulcio"),
            ]
        )
        ski = x509.SubjectKeyIdentifier.from_public_key(self.key.public_key())
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=30))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=1), True)
            .add_extension(key_usage("key_cert_sign", "crl_sign"), True)
            .add_extension(ski, False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                False,
            )
            .sign(self.key, hashes.SHA256())
        )


def _sct_list(ct_key, tbs_precert: bytes, issuer_key_hash: bytes, ms: int) -> bytes:
    """The TLS-encoded SignedCertificateTimestampList of one v1 SCT over a
    precertificate entry (RFC 6962 3.2), as Fulcio embeds it. `verify_sct`
    rebuilds this signed struct from the certificate and checks it with the
    trusted CT keys."""
    signed = (
        struct.pack("!BBQH", 0, 0, ms, 1)  # v1, certificate_timestamp, precert_entry
        + issuer_key_hash
        + struct.pack("!I", len(tbs_precert))[1:]  # opaque TBSCertificate<1..2^24-1>
        + tbs_precert
        + struct.pack("!H", 0)  # no CtExtensions
    )
    signature = ct_key.sign(signed, _ECDSA)
    sct = (
        struct.pack("!B32sQH", 0, key_id(ct_key), ms, 0)
        + struct.pack("!BBH", 4, 3, len(signature))  # sha256, ecdsa
        + signature
    )
    serialized = struct.pack("!H", len(sct)) + sct
    return struct.pack("!H", len(serialized)) + serialized


def _merkle_root(leaves: list[bytes]) -> bytes:
    """RFC 6962 Merkle tree hash (0x00 leaf prefix, 0x01 node prefix)."""
    if len(leaves) == 1:
        return hashlib.sha256(b"\0" + leaves[0]).digest()
    k = 1 << ((len(leaves) - 1).bit_length() - 1)  # largest power of 2 < n
    return hashlib.sha256(
        b"\1" + _merkle_root(leaves[:k]) + _merkle_root(leaves[k:])
    ).digest()


def _inclusion_path(index: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 6962 audit path of leaf `index`, leaf to root (what
    `verify_merkle_inclusion` chains back to the root hash)."""
    if len(leaves) == 1:
        return []
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    if index < k:
        return _inclusion_path(index, leaves[:k]) + [_merkle_root(leaves[k:])]
    return _inclusion_path(index - k, leaves[k:]) + [_merkle_root(leaves[:k])]


class PrivateSigstore:
    def __init__(self, root: Path, name: str = "releasegate-test"):
        self.root, self.name = root, name
        self.now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        self.ca = Authority(name, self.now)
        self.ct_key = new_key()
        self.log_key = new_key()
        self.origin = f"rekor.{name}.invalid - 1"  # checkpoint origin line

    # --- trust config -----------------------------------------------------

    def trust_config(self) -> Path:
        """A ClientTrustConfig pinning our CA, CT log key and Rekor key (and
        nothing else: no TSA, so the verified time is Rekor's integrated time)."""
        start = {"start": (self.now - datetime.timedelta(days=1)).isoformat()}
        ca_der = b64(self.ca.cert.public_bytes(DER))

        def log(key, url):
            return {
                "baseUrl": url,
                "hashAlgorithm": "SHA2_256",
                "publicKey": {
                    "rawBytes": b64(der(key)),
                    "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                    "validFor": start,
                },
                "logId": {"keyId": b64(key_id(key))},
            }

        def service(url):  # signing config only; verification never reads it
            return {
                "url": url,
                "majorApiVersion": 1,
                "validFor": start,
                "operator": self.name,
            }

        config = {
            "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
            "trustedRoot": {
                "mediaType": TRUSTED_ROOT,
                "tlogs": [log(self.log_key, "http://127.0.0.1:9/rekor")],
                "certificateAuthorities": [
                    {
                        "subject": {"organization": self.name, "commonName": "fulcio"},
                        "uri": "http://127.0.0.1:9/fulcio",
                        "certChain": {"certificates": [{"rawBytes": ca_der}]},
                        "validFor": start,
                    }
                ],
                "ctlogs": [log(self.ct_key, "http://127.0.0.1:9/ctfe")],
                "timestampAuthorities": [],
            },
            "signingConfig": {
                "mediaType": "application/vnd.dev.sigstore.signingconfig.v0.2+json",
                "caUrls": [service("http://127.0.0.1:9/fulcio")],
                "oidcUrls": [service("http://127.0.0.1:9/oauth2")],
                "rekorTlogUrls": [service("http://127.0.0.1:9/rekor")],
                "tsaUrls": [service("http://127.0.0.1:9/tsa")],
                "rekorTlogConfig": {"selector": "ANY"},
                "tsaConfig": {"selector": "ANY"},
            },
        }
        path = self.root / f"{self.name}-trust-config.json"
        path.write_text(json.dumps(config, indent=2))
        return path

    # --- Fulcio -------------------------------------------------------------

    def _leaf(self, key, identity: str, issuer: str, ca: Authority, ct_key, sct):
        """A Fulcio-style leaf: empty subject, critical SAN (email or URI), the
        code-signing EKU, the OIDC issuer extensions and an embedded SCT."""
        san = (
            x509.UniformResourceIdentifier(identity)
            if "://" in identity
            else x509.RFC822Name(identity)
        )
        ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(ca.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(minutes=1))
            .not_valid_after(self.now + datetime.timedelta(minutes=10))
        )
        for extension, critical in [
            (key_usage("digital_signature"), True),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), False),
            (x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False),
            (
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                    ca_ski.value
                ),
                False,
            ),
            (x509.SubjectAlternativeName([san]), True),  # critical: empty subject
            (x509.UnrecognizedExtension(OIDC_ISSUER, issuer.encode()), False),
            (
                x509.UnrecognizedExtension(
                    OIDC_ISSUER_V2, der_value(UTF8_STRING, issuer.encode())
                ),
                False,
            ),
        ]:
            builder = builder.add_extension(extension, critical)
        if not sct:
            return builder.sign(ca.key, hashes.SHA256())
        ms = int(self.now.timestamp() * 1000)
        issuer_hash = key_id(ca.key)  # SHA-256 of the issuer's SPKI

        def with_scts(scts: bytes):
            ext = x509.UnrecognizedExtension(SCT_LIST, der_value(OCTET_STRING, scts))
            return builder.add_extension(ext, False).sign(ca.key, hashes.SHA256())

        # The SCT signs the TBSCertificate without the SCT list extension: build
        # once with a placeholder to get those bytes, then with the real SCT.
        placeholder = with_scts(_sct_list(new_key(), b"", bytes(32), ms))
        return with_scts(
            _sct_list(ct_key, placeholder.tbs_precertificate_bytes, issuer_hash, ms)
        )

    # --- signing -----------------------------------------------------------

    def sign_bundle(
        self,
        payload: bytes,
        identity: str,
        issuer: str,
        *,
        ca: Authority | None = None,
        ct_key=None,
        log_key=None,
        sct: bool = True,
        logged_payload: bytes | None = None,
        tree_size: int = 7,
        index: int = 5,
    ) -> str:
        """A Sigstore bundle v0.3 for a DSSE envelope of `payload` (in-toto).

        `ca`, `ct_key`, `log_key`: issue the certificate / sign the SCT / run the
        log with something other than what `trust_config()` pins; `sct=False`:
        no embedded SCT; `logged_payload`: the log entry records this payload
        instead of the signed one. The entry sits at `index` of a log of `tree_size`
        entries (the others are filler), so the inclusion proof has both inner
        and right-border hashes.
        """
        ca, ct_key = ca or self.ca, ct_key or self.ct_key
        log_key = log_key or self.log_key
        key = new_key()  # the ephemeral keyless signing key
        cert = self._leaf(key, identity, issuer, ca, ct_key, sct)
        signature = key.sign(pae(payload), _ECDSA)  # DSSE: ECDSA over PAE
        envelope = {
            "payload": b64(payload),
            "payloadType": IN_TOTO,
            "signatures": [{"sig": b64(signature), "keyid": ""}],
        }
        # Rekor dsse 0.0.1 entry: `_validate_dsse_v001_entry_body` checks the
        # payload hash and (signature, PEM certificate) against the bundle.
        body = rfc8785.dumps(
            {
                "apiVersion": "0.0.1",
                "kind": "dsse",
                "spec": {
                    "envelopeHash": sha256(rfc8785.dumps(envelope)),
                    "payloadHash": sha256(logged_payload or payload),
                    "signatures": [
                        {
                            "signature": b64(signature),
                            "verifier": b64(cert.public_bytes(PEM)),
                        }
                    ],
                },
            }
        )
        leaves = [f"filler entry {i}".encode() for i in range(tree_size)]
        leaves[index] = body
        root = _merkle_root(leaves)
        log_id = key_id(log_key)
        integrated = int(self.now.timestamp())
        # Signed checkpoint (signed note): "— <name> b64(key hint[4] + sig)";
        # `verify_checkpoint` checks the signature and that it names our root.
        note = f"{self.origin}\n{tree_size}\n{b64(root)}\n"
        note_sig = log_id[:4] + log_key.sign(note.encode(), _ECDSA)
        checkpoint = f"{note}\n\u2014 {self.origin.split()[0]} {b64(note_sig)}\n"
        # Inclusion promise: the log's signature over the canonical entry; it
        # is what makes `integratedTime` a verified time for the chain check.
        promise = {"body": b64(body), "integratedTime": integrated}
        promise |= {"logID": log_id.hex(), "logIndex": index}
        promise_sig = log_key.sign(rfc8785.dumps(promise), _ECDSA)
        bundle = {
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": b64(cert.public_bytes(DER))},
                "tlogEntries": [
                    {
                        "logIndex": str(index),
                        "logId": {"keyId": b64(log_id)},
                        "kindVersion": {"kind": "dsse", "version": "0.0.1"},
                        "integratedTime": str(integrated),
                        "inclusionPromise": {"signedEntryTimestamp": b64(promise_sig)},
                        "inclusionProof": {
                            "logIndex": str(index),
                            "rootHash": b64(root),
                            "treeSize": str(tree_size),
                            "hashes": [b64(h) for h in _inclusion_path(index, leaves)],
                            "checkpoint": {"envelope": checkpoint},
                        },
                        "canonicalizedBody": b64(body),
                    }
                ],
            },
            "dsseEnvelope": envelope,
        }
        return json.dumps(bundle, indent=2)
