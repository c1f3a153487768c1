from controlplane.releases.actions.jobs import do_finish_job, do_start_job


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


def _pipelines(client) -> list[int]:
    return [row["release"].pk for row in client.get("/").context["pipelines"]]


def test_it_leaves_out_releases_waiting_for_a_person(
    client, owner, make_release, awaiting
):
    # Gates passed: awaiting approval. Gates inconclusive: paused in gated.
    waiting = awaiting("1.0.0")
    paused = make_release("1.1.0", state="gated")
    do_finish_job(do_start_job(paused, "gate"), result={"outcome": "inconclusive"})
    failed = make_release("1.2.0", state="failed", failure_reason="failed gates")
    deciding = make_release("1.3.0", state="gated")
    do_start_job(deciding, "gate")
    client.force_login(owner)

    listed = _pipelines(client)

    assert listed == [deciding.pk]
    assert {waiting.pk, paused.pk, failed.pk}.isdisjoint(listed)


def test_it_shows_a_skipped_stage_as_skipped(client, owner, make_release):
    running = make_release("1.1.0", state="evaluating")
    do_finish_job(do_start_job(running, "compress"), result={"skipped": "not built"})
    do_start_job(running, "evaluate")
    client.force_login(owner)

    body = client.get("/pipelines/").content.decode()

    assert 'data-outcome="skipped"' in body
    assert "not built" in body
    assert 'data-outcome="succeeded"' not in body
