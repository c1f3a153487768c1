from controlplane.releases.models import Release


def test_it_rejects_through_the_action(client, teammate, make_release):
    release = make_release(state="awaiting_approval")
    client.force_login(teammate)

    response = client.post(f"/releases/{release.pk}/reject/", {"comment": "no"})

    assert response.status_code == 302
    stored = Release.objects.get(pk=release.pk)
    assert (stored.state, stored.failure_reason) == ("rejected", "no")


def test_it_is_403_for_members(client, member, make_release):
    release = make_release(state="awaiting_approval")
    client.force_login(member)

    assert client.post(f"/releases/{release.pk}/reject/").status_code == 403


def test_it_is_404_for_outsiders(client, outsider, make_release):
    release = make_release(state="awaiting_approval")
    client.force_login(outsider)

    assert client.post(f"/releases/{release.pk}/reject/").status_code == 404
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"


def test_it_shows_why_a_live_release_cannot_be_rejected(client, teammate, make_release):
    release = make_release(state="live")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": "no"}, follow=True
    )

    assert b"illegal release transition live -&gt; rejected" in response.content


def test_it_needs_a_reason(client, teammate, make_release):
    release = make_release(state="awaiting_approval")
    client.force_login(teammate)

    response = client.post(
        f"/releases/{release.pk}/reject/", {"comment": " "}, follow=True
    )

    assert b"a rejection needs a reason" in response.content
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"


def test_it_is_403_for_the_registrant(client, teammate, owner, make_release):
    release = make_release(state="awaiting_approval", actor=teammate)
    client.force_login(teammate)

    response = client.post(f"/releases/{release.pk}/reject/", {"comment": "mine"})

    assert response.status_code == 403
    assert b"registered" in response.content
    assert Release.objects.get(pk=release.pk).state == "awaiting_approval"
