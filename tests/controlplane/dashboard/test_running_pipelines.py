from controlplane.releases.actions import do_start_job


def test_it_renders_the_running_pipelines_fragment(client, owner, make_release):
    running = make_release("1.1.0", state="compressing")
    job = do_start_job(running, "compress")
    job.progress = 0.4
    job.save(update_fields=["progress"])
    client.force_login(owner)

    response = client.get("/pipelines/")

    body = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in body
    assert f'href="/releases/{running.pk}/"' in body
    assert 'aria-valuenow="40"' in body


def test_it_sends_an_ended_session_to_login(client, release):
    assert client.get("/pipelines/").status_code == 302


def test_it_shows_outsiders_no_pipeline(client, outsider, make_release):
    running = make_release("1.1.0", state="compressing")
    client.force_login(outsider)

    response = client.get("/pipelines/")

    assert str(running).encode() not in response.content
    assert b"No pipeline is running." in response.content
