import pytest

from controlplane.accounts.actions import do_set_team_source_roots, team_source_roots
from controlplane.audit.models import AuditEvent
from controlplane.errors import ValidationFailed


def test_it_defaults_to_the_teams_folder_in_each_host_root(team, settings, tmp_path):
    settings.RELEASEGATE_SOURCE_ROOTS = [tmp_path / "a", tmp_path / "b"]

    assert team_source_roots(team) == [tmp_path / "a" / "acme", tmp_path / "b" / "acme"]


def test_it_sets_roots_inside_the_host_roots(team, source_roots):
    do_set_team_source_roots(
        team, [f"{source_roots}/shared//models/"], actor="operator"
    )

    team.refresh_from_db()
    assert team.source_roots == [f"{source_roots}/shared/models"]
    assert team_source_roots(team) == [source_roots / "shared" / "models"]
    event = AuditEvent.objects.get(verb="team.source_roots_set")
    assert event.after == {"source_roots": team.source_roots}


@pytest.mark.parametrize(
    ("root", "problem"),
    [
        ("/etc", "outside this host's source roots"),
        ("relative/path", "must be an absolute path"),
        ("{root}/acme/../other", "must not contain '..'"),
        ("{root}-sibling", "outside this host's source roots"),
    ],
)
def test_it_refuses_roots_outside_the_host_roots(team, source_roots, root, problem):
    with pytest.raises(ValidationFailed, match=problem):
        do_set_team_source_roots(
            team, [root.format(root=source_roots)], actor="operator"
        )

    team.refresh_from_db()
    assert team.source_roots == []


def test_it_drops_roots_the_host_no_longer_allows(team, source_roots, settings):
    team = do_set_team_source_roots(team, [str(source_roots / "x")], actor="op")
    settings.RELEASEGATE_SOURCE_ROOTS = [source_roots / "elsewhere"]

    assert team_source_roots(team) == []
