"""The OpenAPI document is the API's contract: schemathesis sends every operation generated requests, valid
and not, with a user's API token, and fails on any 5xx, a status the document does not list for the operation,
or an answer that does not match its documented schema. The real Django application answers in this process
(WSGI), on the test database; no Celery worker runs, so a launched run just stays queued."""

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from loom.api.urls import api

from .helpers import BatchSender, batch, claimed_run

pytestmark = pytest.mark.django_db

# Enough to reach each operation's error paths (missing, mistyped and unknown fields, bad ids) while the file
# runs in a few minutes on two cores: about 26 operations × this many cases each, both positive and negative.
EXAMPLES_PER_OPERATION = 60


@pytest.fixture
def api_token(platform_user, token_for):
    return token_for(platform_user[0])


# The document as /api/openapi.json serves it (test_the_served_document_is_the_one_tested checks that they agree).
schema = schemathesis.openapi.from_dict(api.get_openapi_schema(path_prefix="/api/"))
# Requests go to the application in this process; the host only completes the URL.
schema.config.update(base_url="http://testserver")

# What the contract promises: no 5xx, only documented statuses, content types and bodies, and invalid input
# refused. Not that every schema-valid body is accepted: a run config's rules span fields (heads must divide
# dim), which the document states in words, so a generated config is mostly refused, rightly, with a 400.
CONTRACT = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]

APP = WSGIHandler()


@pytest.fixture
def trained_run(platform_user):
    """A run of the user's whose attempt has reported steps, so operations on a run answer with data too."""
    run, attempt, _ = claimed_run(platform_user[0], name="contract")
    sender = BatchSender(attempt)
    for rank in range(2):
        sender.send(rank, *batch(attempt, rank=rank, steps=range(1, 9))["events"])
    return run


def aimed_at(case, run):
    """Most generated run ids name no run (a 404); an even one is pointed at the trained run instead."""
    run_id = (case.path_parameters or {}).get("run_id")
    if isinstance(run_id, int) and not isinstance(run_id, bool) and run_id % 2 == 0:
        case.path_parameters["run_id"] = run.pk
    return case


@pytest.fixture
def in_test_transaction():
    """Keep Django from closing the test's database connection as each request ends (its test client does the
    same), so every request sees, and rolls back with, the test's transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented(case, api_token, trained_run, in_test_transaction):
    aimed_at(case, trained_run).call_and_validate(
        app=APP, headers={"Authorization": f"Bearer {api_token}"}, checks=CONTRACT
    )


def test_the_served_document_is_the_one_tested(client, api_token):
    response = client.get("/api/openapi.json", HTTP_AUTHORIZATION=f"Bearer {api_token}")
    assert response.status_code == 200
    assert response.json() == schema.raw_schema
