from tests.controlplane.conftest import PASSWORD


def test_it_shows_the_login_form(client, db):
    response = client.get("/accounts/login/")

    assert response.status_code == 200
    assert b'name="password"' in response.content
    assert b"csrfmiddlewaretoken" in response.content


def test_it_logs_in_and_lands_on_the_release_list(client, owner, release):
    response = client.post(
        "/accounts/login/", {"username": "alice", "password": PASSWORD}, follow=True
    )

    assert response.redirect_chain[-1][0] == "/"
    assert str(release).encode() in response.content


def test_it_refuses_a_wrong_password(client, owner):
    response = client.post("/accounts/login/", {"username": "alice", "password": "x"})

    assert response.status_code == 200
    assert b"Wrong username or password" in response.content
    assert "_auth_user_id" not in client.session


def test_it_logs_out_with_post(client, owner):
    client.force_login(owner)

    response = client.post("/accounts/logout/")

    assert response.status_code == 302
    assert "_auth_user_id" not in client.session
