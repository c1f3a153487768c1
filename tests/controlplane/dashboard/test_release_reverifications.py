from controlplane.dashboard.views.releases import REVERIFICATIONS_PER_PAGE
from tests.controlplane.api.test_get_release import reverified


def test_it_lists_every_re_verification_newest_first_in_pages(
    client, teammate, make_live
):
    release = make_live("1.0.0")
    jobs = reverified(release, REVERIFICATIONS_PER_PAGE + 1, last_error="changed: x")
    client.force_login(teammate)

    first = client.get(f"/releases/{release.pk}/reverifications/")
    second = client.get(f"/releases/{release.pk}/reverifications/", {"page": 2})

    assert first.status_code == 200
    shown = list(first.context["page"].object_list)
    assert shown[0] == jobs[-1]  # newest first
    assert len(shown) == REVERIFICATIONS_PER_PAGE
    assert list(second.context["page"].object_list) == [jobs[0]]
    assert "changed: x" in first.content.decode()


def test_it_is_404_for_outsiders(client, outsider, release):
    reverified(release, 1)
    client.force_login(outsider)

    response = client.get(f"/releases/{release.pk}/reverifications/")

    assert response.status_code == 404
