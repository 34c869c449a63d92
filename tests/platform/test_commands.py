from io import StringIO

import pytest
from django.contrib.auth import authenticate
from django.core.management import call_command
from django.test import RequestFactory

from loom.runs import states
from loom.runs.models import Run

pytestmark = pytest.mark.django_db


def test_create_api_user_prints_a_token_that_authenticates_the_api(client):
    out = StringIO()
    call_command("create_api_user", "bob", "--password", "pw-for-bob", stdout=out)
    token = out.getvalue().strip()
    assert token.startswith("loom_")
    assert authenticate(RequestFactory().post("/login/"), username="bob", password="pw-for-bob") is not None
    response = client.get("/api/runs", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200 and response.json()["runs"] == []


def test_each_call_mints_a_new_token_and_keeps_the_old_ones_valid(client):
    tokens = []
    for _ in range(2):
        out = StringIO()
        call_command("create_api_user", "bob", stdout=out)
        tokens.append(out.getvalue().strip())
    assert tokens[0] != tokens[1]
    for token in tokens:
        assert client.get("/api/runs", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200


def test_demo_creates_the_login_and_a_queued_run_with_a_valid_config():
    out = StringIO()
    call_command("demo", "--url", "http://127.0.0.1:9999", stdout=out)
    run = Run.objects.get()
    assert (run.owner.username, run.state) == ("demo", states.QUEUED)
    assert run.config["parallel"]["dp_replicate"] == 2
    assert authenticate(RequestFactory().post("/login/"), username="demo", password="demo") is not None
    assert f"http://127.0.0.1:9999/runs/{run.pk}/" in out.getvalue()
