"""The client's route table (loom_client/routes.py) against the platform's OpenAPI document, as a script with
its token reads it: every method and path template the client calls, each query parameter and body field it
sends and each field it reads from an answer must be in the document."""

from typing import get_args

import pytest
from django.test import Client

from loom_client import models, routes
from loom_client.routes import Route

pytestmark = pytest.mark.django_db

# What each route answers, as the client reads it; a list answer is read item by item.
ANSWERS = {
    routes.SUBMIT_RUN: models.CreatedRun,
    routes.LIST_RUNS: models.RunPage,
    routes.SHOW_RUN: models.RunDetail,
    routes.EDIT_RUN: models.RunDetail,
    routes.CANCEL_RUN: models.RunDetail,
    routes.RUN_EVENTS: models.EventPage,
    routes.RANK_LOG: models.LogTail,
    routes.RUN_CHECKPOINTS: models.Checkpoint,
    routes.RESTORE: models.Restored,
    routes.RUN_ALERTS: models.Alert,
}


class ColouredRun(models.ListedRun):
    """A listed run with a field no answer has: the check must find it inside a page."""

    colour: str


class Paged(models.Answer):
    runs: list[ColouredRun]


@pytest.fixture
def document(platform_user, token_for):
    response = Client().get("/api/openapi.json", HTTP_AUTHORIZATION=f"Bearer {token_for(platform_user[0])}")
    assert response.status_code == 200
    return response.json()


def resolved(document: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def request_problems(document: dict, route: Route) -> list[str]:
    """What the client sends along `route` that the document does not have."""
    operation = document["paths"].get(route.path, {}).get(route.method.lower())
    if operation is None:
        return [f"{route.method} {route.path} is not in the document"]
    problems = []
    path_parameters = {parameter["name"] for parameter in operation.get("parameters", []) if parameter["in"] == "path"}
    if path_parameters != _placeholders(route.path):
        problems.append(f"{route.path}: path parameters {sorted(path_parameters)}")
    query = {parameter["name"] for parameter in operation.get("parameters", []) if parameter["in"] == "query"}
    problems += [f"{route.path}: no query parameter {name!r}" for name in route.query if name not in query]
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    fields = resolved(document, body).get("properties", {})
    problems += [f"{route.path}: no body field {name!r}" for name in route.body if name not in fields]
    return problems


def _placeholders(path: str) -> set[str]:
    return {part[1:-1] for part in path.split("/") if part.startswith("{")}


def answer_problems(document: dict, route: Route, model) -> list[str]:
    """Fields the client's model reads that the route's success answer does not document."""
    operation = document["paths"].get(route.path, {}).get(route.method.lower())
    if operation is None:
        return [f"{route.method} {route.path} is not in the document"]
    success = next(answer for status, answer in operation["responses"].items() if status.startswith("2"))
    return _model_problems(
        document, success["content"]["application/json"]["schema"], model, f"{route.path}: the answer"
    )


def _model_problems(document: dict, schema: dict, model, where: str) -> list[str]:
    """The fields of `model`, and of the models nested in it (a run page's runs), missing from `schema`."""
    schema = resolved(document, schema)
    if schema.get("type") == "array":
        schema = resolved(document, schema["items"])
    documented = schema.get("properties", {})
    problems = []
    for name, field in model.model_fields.items():
        if name not in documented:
            problems.append(f"{where} has no field {name!r}")
            continue
        nested = next((kind for kind in (field.annotation, *get_args(field.annotation)) if _is_model(kind)), None)
        if nested is not None:
            problems += _model_problems(document, documented[name], nested, f"{where}'s {name}")
    return problems


def _is_model(kind) -> bool:
    return isinstance(kind, type) and issubclass(kind, models.Answer)


def test_every_route_the_client_calls_is_in_the_document_with_what_it_sends(document):
    assert [problem for route in routes.HTTP_ROUTES for problem in request_problems(document, route)] == []


def test_every_field_the_client_reads_is_in_the_answers_documented(document):
    assert set(ANSWERS) == set(routes.HTTP_ROUTES)
    assert [problem for route, model in ANSWERS.items() for problem in answer_problems(document, route, model)] == []


def test_the_check_catches_a_wrong_path_a_wrong_method_and_an_unknown_parameter(document):
    assert request_problems(document, Route("GET", "/api/run/{run_id}")) == [
        "GET /api/run/{run_id} is not in the document"
    ]
    assert request_problems(document, Route("DELETE", "/api/runs/{run_id}")) != []
    assert request_problems(document, Route("PATCH", "/api/runs/{run_id}", body=("tags", "colour"))) == [
        "/api/runs/{run_id}: no body field 'colour'"
    ]
    assert request_problems(document, Route("GET", "/api/runs/{run_id}/events", query=("after", "since"))) == [
        "/api/runs/{run_id}/events: no query parameter 'since'"
    ]
    assert request_problems(document, Route("POST", "/api/runs/{run_id}/restore", body=("checkpoint", "layout"))) == [
        "/api/runs/{run_id}/restore: no body field 'layout'"
    ]
    assert answer_problems(document, routes.SHOW_RUN, models.CreatedRun) == [
        "/api/runs/{run_id}: the answer has no field 'warnings'"
    ]
    # Into the models an answer nests: a run page's runs.
    assert answer_problems(document, routes.LIST_RUNS, models.RunPage) == []
    assert answer_problems(document, routes.SHOW_RUN, models.RunPage) == [
        "/api/runs/{run_id}: the answer has no field 'runs'",
        "/api/runs/{run_id}: the answer has no field 'next_cursor'",
    ]
    assert answer_problems(document, routes.LIST_RUNS, Paged) == ["/api/runs: the answer's runs has no field 'colour'"]
