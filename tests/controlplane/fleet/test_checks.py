"""`manage.py check --deploy` warns of agent identity settings left at their dev
values (controlplane.fleet.checks)."""

from controlplane.fleet.checks import check_agent_identity_settings


def ids(warnings) -> set[str]:
    return {w.id for w in warnings}


def test_it_warns_of_a_control_plane_key_made_on_first_use(settings, monkeypatch):
    monkeypatch.delenv("RELEASEGATE_CONTROLPLANE_KEY", raising=False)
    settings.RELEASEGATE_ALLOW_VERIFY_ON_SIGNER = False

    assert ids(check_agent_identity_settings()) == {"fleet.W001"}


def test_it_warns_when_the_signer_may_verify(settings, monkeypatch):
    monkeypatch.setenv("RELEASEGATE_CONTROLPLANE_KEY", "/etc/releasegate/cp.key")
    settings.RELEASEGATE_ALLOW_VERIFY_ON_SIGNER = True

    assert ids(check_agent_identity_settings()) == {"fleet.W002"}


def test_it_is_quiet_when_both_are_set_for_production(settings, monkeypatch):
    monkeypatch.setenv("RELEASEGATE_CONTROLPLANE_KEY", "/etc/releasegate/cp.key")
    settings.RELEASEGATE_ALLOW_VERIFY_ON_SIGNER = False

    assert check_agent_identity_settings() == []
