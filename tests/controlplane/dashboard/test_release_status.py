from controlplane.releases.actions.jobs import do_start_job


def test_it_renders_the_state_and_stages_fragment(client, owner, make_release):
    release = make_release("1.0.0", state="verifying")
    do_start_job(release, "verify_source")
    client.force_login(owner)

    response = client.get(f"/releases/{release.pk}/status/")

    body = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in body
    assert '<span class="state state-verifying">verifying</span>' in body
    assert '<tr data-stage="verify_source">' in body


def test_it_is_404_for_outsiders(client, outsider, release):
    client.force_login(outsider)

    assert client.get(f"/releases/{release.pk}/status/").status_code == 404
