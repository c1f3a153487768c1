"""gpuagent.integrity.policy: the policy and release built from command-line flags
(shared by `python -m gpuagent.integrity verify` and `python -m gpuagent.engine serve`).
"""

import pytest

from gpuagent.integrity import DEFAULT_POLICY, ReleaseBinding
from gpuagent.integrity.policy import policy_from_flags, release_from_flags


def test_it_trusts_exactly_the_given_keys_and_leaves_out_the_signature(keys):
    policy = policy_from_flags(
        public_keys_pem=[keys.public_pem], signature_name="release.sig"
    )

    assert policy.signature_mode == "key"
    assert policy.public_keys_pem == (keys.public_pem,)
    assert policy.ignorable_paths() >= {"model.sig", "release.sig"}
    assert policy.release is None
    assert policy.allowed_dtypes == DEFAULT_POLICY.allowed_dtypes  # strict defaults


def test_it_prefers_a_pinned_chain_or_trust_config_over_keys(keys):
    chain = policy_from_flags(
        public_keys_pem=[keys.public_pem],
        certificate_chain_pem=b"-----BEGIN CERTIFICATE-----",
        identity="ci@example.com",
        issuer="Example CA",
    )
    sigstore = policy_from_flags(
        sigstore_trust_config="trust.json", identity="ci@example.com", issuer="x"
    )

    assert chain.signature_mode == "certificate"
    assert chain.certificate_identity == "ci@example.com"
    assert chain.public_keys_pem == ()
    assert sigstore.signature_mode == "sigstore"
    assert sigstore.sigstore_trust_config == "trust.json"


def test_it_refuses_to_build_a_policy_that_trusts_nobody():
    with pytest.raises(ValueError, match="public key"):
        policy_from_flags(signature_name="model.sig")


def test_it_reads_a_release_only_when_model_version_and_recipe_come_together():
    assert release_from_flags(None, None, None) is None
    assert release_from_flags("m", "1", "int8", "sha256:ab") == ReleaseBinding(
        "m", "1", "int8", "sha256:ab"
    )
    with pytest.raises(ValueError, match="together"):
        release_from_flags("m", None, "int8")


def test_it_leaves_out_only_signature_file_names(keys):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        policy = policy_from_flags(
            public_keys_pem=[keys.public_pem], signature_name=name
        )
        assert name not in policy.ignorable_paths()
    for name in ("release.sig", "model.sigstore.json", "m.sigstore", "m.bundle"):
        policy = policy_from_flags(
            public_keys_pem=[keys.public_pem], signature_name=name
        )
        assert name in policy.ignorable_paths()
