"""API tokens: created with the value shown once, listed without it, revoked or expired into a 401."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from loom.accounts.models import ApiToken
from loom.accounts.services import issue_api_token, user_for_api_token
from loom.accounts.tokens import hash_token

pytestmark = pytest.mark.django_db


def call(client, method, path, token=None, body=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    kwargs = {"data": json.dumps(body), "content_type": "application/json"} if body is not None else {}
    return getattr(client, method)(path, **kwargs, **headers)


def test_a_created_token_is_shown_once_works_and_is_listed_without_its_value(client, platform_user, token_for):
    user = platform_user[0]
    first = token_for(user)
    created = call(client, "post", "/api/tokens", first, {"name": "nightly sweep", "expires_in_days": 30})
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["name"] == "nightly sweep"
    assert body["token"].startswith("loom_")
    assert body["last_used_at"] is None
    expires = timezone.datetime.fromisoformat(body["expires_at"])
    assert expires - timezone.datetime.fromisoformat(body["created_at"]) == pytest.approx(
        timedelta(days=30), abs=timedelta(seconds=5)
    )
    assert ApiToken.objects.get(pk=body["id"]).key_hash == hash_token(body["token"])

    assert call(client, "get", "/api/runs", body["token"]).status_code == 200
    listed = call(client, "get", "/api/tokens", body["token"]).json()
    assert [token["name"] for token in listed] == ["nightly sweep", "tests"]
    assert all("token" not in token for token in listed)
    assert listed[0]["last_used_at"] is not None
    assert listed[1]["expires_at"] is None


def test_a_revoked_token_is_refused(client, platform_user, token_for):
    keeper, revoked = token_for(platform_user[0]), token_for(platform_user[0])
    revoked_id = ApiToken.objects.get(key_hash=hash_token(revoked)).pk
    assert call(client, "get", "/api/runs", revoked).status_code == 200
    assert call(client, "delete", f"/api/tokens/{revoked_id}", keeper).status_code == 204
    assert call(client, "get", "/api/runs", revoked).status_code == 401
    assert call(client, "get", "/api/runs", keeper).status_code == 200


def test_another_users_token_cannot_be_revoked_or_listed(client, platform_user, other_user, token_for):
    mine, theirs = token_for(platform_user[0]), token_for(other_user)
    their_id = ApiToken.objects.get(key_hash=hash_token(theirs)).pk
    assert call(client, "delete", f"/api/tokens/{their_id}", mine).status_code == 404
    assert their_id not in [token["id"] for token in call(client, "get", "/api/tokens", mine).json()]
    assert call(client, "get", "/api/runs", theirs).status_code == 200


def test_an_expired_token_is_refused(client, platform_user):
    token, value = issue_api_token(platform_user[0], "short-lived", expires_in_days=1)
    assert call(client, "get", "/api/runs", value).status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert call(client, "get", "/api/runs", value).status_code == 401


def test_a_token_is_live_until_the_moment_it_expires(platform_user):
    token, value = issue_api_token(platform_user[0], "a day", expires_in_days=1)
    assert user_for_api_token(value, now=token.expires_at - timedelta(microseconds=1)) == platform_user[0]
    assert user_for_api_token(value, now=token.expires_at) is None


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"name": "  "}, "name", "is required: say what uses the token (a script, a CI job)"),
        ({"name": "x" * 101}, "name", "must be at most 100 characters"),
        (
            {"name": "ci", "expires_in_days": 0},
            "expires_in_days",
            "must be a whole number of days from 1 to 3650, or empty for never",
        ),
    ],
)
def test_bad_token_input_is_a_field_error_and_creates_nothing(client, platform_user, token_for, body, field, message):
    token = token_for(platform_user[0])
    response = call(client, "post", "/api/tokens", token, body)
    assert response.status_code == 400
    assert response.json() == {"errors": {field: message}}
    assert ApiToken.objects.count() == 1


def test_the_tokens_page_creates_shows_once_lists_and_revokes(client, platform_user):
    client.force_login(platform_user[0])
    page = client.get("/account/tokens/")
    assert page.status_code == 200
    assert b'href="/account/tokens/"' in page.content  # the nav links to it

    created = client.post("/account/tokens/", {"name": "laptop", "expires_in_days": "7"})
    assert created.status_code == 201
    token = ApiToken.objects.get(name="laptop")
    value = created.context["value"]
    assert hash_token(value) == token.key_hash
    assert value.encode() in created.content
    assert token.expires_at - token.created_at == pytest.approx(timedelta(days=7), abs=timedelta(seconds=5))

    listed = client.get("/account/tokens/")
    assert b"laptop" in listed.content
    assert value.encode() not in listed.content

    assert client.post(f"/account/tokens/{token.pk}/revoke/").status_code == 302
    assert not ApiToken.objects.exists()
    client.logout()  # a script has the token alone, no session
    assert call(client, "get", "/api/runs", value).status_code == 401


def test_the_tokens_page_refuses_bad_input_next_to_the_field(client, platform_user):
    client.force_login(platform_user[0])
    response = client.post("/account/tokens/", {"name": "", "expires_in_days": "soon"})
    assert response.status_code == 400
    assert response.context["errors"] == {
        "name": "is required: say what uses the token (a script, a CI job)",
        "expires_in_days": "must be a whole number of days from 1 to 3650, or empty for never",
    }
    assert not ApiToken.objects.exists()
