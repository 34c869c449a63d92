"""Bad input to the API is refused by field, in one shape ({"errors": {field: message}}), and changes nothing;
what the API did not foresee is logged with its traceback and answered as JSON."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import RequestFactory

from loom.alerts.models import Webhook
from loom.api.urls import api
from loom.runs.models import Run
from trainer.config import ConfigError, parse_config

from .helpers import TINY_CONFIG

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def token(platform_user, token_for):
    return token_for(platform_user[0])


def post(client, path, token, text):
    """POST `text` exactly as given: what a JSON encoder would refuse to write, too."""
    return client.post(path, text, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")


def run_body(**changes) -> str:
    body = {"name": "strict", "config": TINY_CONFIG}
    for path, value in changes.items():
        *sections, field = path.split(".")
        target = body
        for section in sections:
            target[section] = dict(target[section])
            target = target[section]
        target[field] = value
    return json.dumps(body)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (run_body(**{"config.steps": "5"}), "config.steps", 'must be a valid integer, not "5"'),
        (run_body(**{"config.steps": True}), "config.steps", "must be a valid integer, not true"),
        (run_body(**{"config.steps": 5.0}), "config.steps", "must be a valid integer, not 5.0"),
        (
            run_body(**{"config.optimizer": {"lr": 0.003, "grad_clip": True}}),
            "config.optimizer.grad_clip",
            "must be a valid number, not true",
        ),
        (
            run_body(**{"config.parallel": {"dp_replicate": 2, "zero_stage": True}}),
            "config.parallel.zero_stage",
            "must be 0, 1, 2, 3 or null, not a boolean",
        ),
        (
            run_body(**{"config.optimizer": {"lr": 0.003, "grad_clip": 1.0}}).replace("1.0", "Infinity"),
            "config.optimizer.grad_clip",
            "must be a finite number (JSON has no NaN or Infinity)",
        ),
        (
            run_body(**{"config.optimizer": {"lr": 0.003, "grad_clip": 1.0}}).replace("1.0", "NaN"),
            "config.optimizer.grad_clip",
            "must be a finite number (JSON has no NaN or Infinity)",
        ),
        (run_body(**{"config.colour": "red"}), "config.colour", "is not a known field"),
        (run_body(**{"config.model.colour": "red"}), "config.model.colour", "is not a known field"),
        (run_body(colour="red"), "colour", "is not a known field"),
        (run_body(name="a\x00b"), "name", "must not contain control characters (NUL, tab, newline, escape, …)"),
        (run_body(name="line\nbreak"), "name", "must not contain control characters (NUL, tab, newline, escape, …)"),
        (run_body(name=5), "name", "must be a string"),
    ],
)
def test_a_run_with_a_mistyped_field_is_refused_by_name_and_not_stored(client, token, text, field, message):
    response = post(client, "/api/runs", token, text)
    assert response.status_code == 400, response.content
    assert response.json()["errors"][field] == message
    assert not Run.objects.exists()


def test_nul_in_a_config_string_is_refused_by_the_schema():
    with pytest.raises(ConfigError) as refused:
        parse_config({"checkpoint": {"resume": "step-000010\x00"}})
    assert refused.value.errors == {"checkpoint.resume": "must not contain a NUL character"}


def test_a_validated_config_parses_again_as_stored_and_as_dumped():
    # Strict types must not refuse the platform's own documents: JSON in the database, model_dump in Python.
    config = parse_config({**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "skip_steps": [[3, 4]]}})
    assert parse_config(config.model_dump(mode="json")) == config == parse_config(config.model_dump())


def test_a_well_typed_run_is_still_created(client, token):
    # An int where a float is wanted is a number all the same; tuples arrive as JSON arrays.
    text = run_body(**{"config.optimizer": {"lr": 1, "grad_clip": 2}, "config.data": {"skip_steps": [[3, 4]]}})
    response = post(client, "/api/runs", token, text)
    assert response.status_code == 201, response.content
    assert response.json()["config"]["optimizer"]["grad_clip"] == 2.0
    assert response.json()["config"]["data"]["skip_steps"] == [[3, 4]]


def test_a_fork_name_with_nul_is_refused_and_nothing_is_forked(client, token, platform_user):
    created = post(client, "/api/runs", token, run_body())
    run_id = created.json()["id"]
    body = json.dumps({"checkpoint": 1, "mode": "fork", "name": "fork\x00"})
    response = post(client, f"/api/runs/{run_id}/restore", token, body)
    assert response.status_code == 400
    assert response.json() == {"errors": {"name": "must not contain control characters (NUL, tab, newline, escape, …)"}}
    assert Run.objects.count() == 1


@pytest.mark.parametrize(
    "path", ["/api/runs", "/api/plan/estimate", "/api/plan/search", "/api/plan/traffic", "/api/plan/export"]
)
@pytest.mark.parametrize("text", ["{", "not json", '{"name": "x",}', "\xff"])
def test_an_unparseable_body_is_a_field_error_not_a_detail(client, token, path, text):
    response = post(client, path, token, text)
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert list(errors) == ["body"]
    assert errors["body"].startswith("must be a JSON document: ")
    assert not Run.objects.exists()


def test_an_unparseable_webhook_creates_no_webhook(client, token):
    response = post(client, "/api/webhooks", token, '{"url": ')
    assert (response.status_code, list(response.json()["errors"])) == (400, ["body"])
    assert not Webhook.objects.exists()


def test_a_body_past_the_upload_limit_is_a_413_naming_the_limit(client, token, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    response = post(client, "/api/runs", token, run_body(name="x" * 2000))
    assert response.status_code == 413
    assert response.json() == {"errors": {"body": "is larger than the 1,000 bytes the server takes"}}
    assert not Run.objects.exists()


def test_export_of_a_null_config_in_an_object_format_is_a_400_naming_the_format(client, token):
    response = post(client, "/api/plan/export", token, '{"config": null, "format": {}}')
    assert response.status_code == 400
    assert response.json() == {"errors": {"format": "must be a string"}}


def test_a_query_parameter_of_the_wrong_type_is_a_400_naming_it(client, token):
    run_id = post(client, "/api/runs", token, run_body()).json()["id"]
    response = client.get(f"/api/runs/{run_id}/events?after=soon", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 400
    assert response.json() == {"errors": {"after": "must be a valid integer"}}


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("delete", "/api/nodes/node%001/exclude", "name"),
        ("get", "/api/runs/{run}/events?kinds=metric%00", "kinds"),
        ("get", "/api/runs/{run}/metrics/ranks?ranks=0%00", "ranks"),
    ],
)
def test_nul_in_a_path_or_query_parameter_is_a_400_naming_it(client, token, method, path, field):
    # PostgreSQL refuses NUL in text: unchecked, a node's name reached the database and answered 500.
    run_id = post(client, "/api/runs", token, run_body()).json()["id"]
    response = getattr(client, method)(path.format(run=run_id), HTTP_AUTHORIZATION=f"Bearer {token}")
    assert (response.status_code, response.json()) == (400, {"errors": {field: "must not contain a NUL character"}})


def test_an_exclusion_reason_with_nul_is_refused(client, token):
    response = post(client, "/api/nodes/node1/exclude", token, json.dumps({"reason": "disk\x00"}))
    assert (response.status_code, response.json()["errors"]["reason"]) == (400, "must not contain a NUL character")


def test_a_missing_run_is_a_404_in_the_errors_shape(client, token):
    response = client.get("/api/runs/987654", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert (response.status_code, response.json()) == (404, {"errors": {"url": "no such run"}})


def test_the_openapi_document_answers_a_bearer_client_and_lists_each_operations_errors(client, token):
    response = client.get("/api/openapi.json", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/json")
    paths = response.json()["paths"]
    create = paths["/api/runs"]["post"]["responses"]
    assert {"201", "400", "401", "413", "500"} <= set(create)
    assert create["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/FieldErrors"}
    assert "404" in paths["/api/runs/{run_id}"]["get"]["responses"]
    # ninja's own 422 never reaches a client: a request that does not fit its schema is a 400.
    assert not any("422" in operation["responses"] for item in paths.values() for operation in item.values())


def provoke(request):
    """What the API answers, and logs, when an operation raises something nobody foresaw."""
    try:
        raise RuntimeError("provoked for the test")
    except RuntimeError as error:
        return api.on_exception(request, error)


def test_an_unhandled_exception_is_logged_with_its_traceback_and_answered_as_json(caplog):
    logger = logging.getLogger("django.request")
    logger.addHandler(caplog.handler)
    try:
        response = provoke(RequestFactory().post("/api/runs"))
    finally:
        logger.removeHandler(caplog.handler)
    assert response.status_code == 500
    assert json.loads(response.content) == {
        "errors": {"server": "the server failed to answer; the error is in its log"}
    }
    (record,) = [record for record in caplog.records if record.name == "django.request"]
    assert record.getMessage() == "Internal Server Error: /api/runs"
    assert "RuntimeError: provoked for the test" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text


def test_with_debug_off_the_traceback_reaches_stderr():
    script = (
        "import django; django.setup()\n"
        "from django.test import RequestFactory\n"
        "from tests.platform.test_strict_input import provoke\n"
        "print(provoke(RequestFactory().get('/api/runs')).status_code)\n"
    )
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "loom.settings",
        "LOOM_DEBUG": "0",
        "LOOM_SECRET_KEY": "strict-input-test-" + "s" * 40,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "500", done.stderr
    assert "Internal Server Error: /api/runs" in done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    assert "RuntimeError: provoked for the test" in done.stderr
