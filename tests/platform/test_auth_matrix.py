"""Who may do what, for every route the platform serves: the routes are read from Django's URL resolver (the
API's operations included: ninja serves each path as a URL pattern) and the Channels websocket routes, so a
route added tomorrow fails test_every_route_is_in_the_matrix until it is given a row here or a reason to be
public. For each route, with its path filled by user A's objects: an anonymous request is refused (401, 403
or a redirect to the login page), user B is refused by session and by API token, an unsafe method sent with
A's session but no CSRF token is refused (403), none of these changes anything of A's or shows any of it,
and A's own request, the same one, is served: the refusals were about who asked."""

import importlib.util
import json
import pkgutil
import re
from dataclasses import dataclass

import pytest
from django.core import serializers
from django.test import Client
from django.urls import URLResolver, get_resolver
from django.utils import timezone
from ninja.operation import PathView
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

import loom
from loom.accounts.models import ApiToken
from loom.accounts.services import create_api_token
from loom.alerts.models import Alert, Webhook
from loom.checkpoints.models import Checkpoint, Pin
from loom.datasets.models import CheckpointExport, Dataset, PretrainedModel
from loom.runs.models import Attempt, Run, RunTag

from .helpers import TINY_CONFIG, claimed_run

# Every object of A's carries this in a name, path or message: it must never reach anyone else.
MARK = "ada-private"
UNSAFE = {"POST", "PUT", "PATCH", "DELETE"}
REFUSED_TO_OTHERS = (403, 404)


@dataclass(frozen=True)
class Ask:
    """How a route is asked. `of_owner`: the request names A's objects (in its path, query or body), so
    anyone else is refused (`refused` statuses); otherwise the route is everyone's own (a list, a form, the
    planner) and B is served, without anything of A's."""

    of_owner: bool = True
    body: dict | None = None
    query: str = ""
    refused: tuple[int, ...] = REFUSED_TO_OTHERS


def everyones(body=None, query="") -> Ask:
    return Ask(of_owner=False, body=body, query=query)


# Routes anyone may use without logging in, and why.
PUBLIC = {
    ("login/", "GET"): "the login page",
    ("login/", "POST"): "logging in (CSRF-protected; throttled per account and address)",
    ("logout/", "GET"): "logging out ends only the asker's own session",
    ("logout/", "POST"): "logging out ends only the asker's own session",
    ("runs/", "GET"): "a redirect to the run list, which asks to log in",
    ("api/", "GET"): "the API's root: a redirect to its docs page, which asks to log in",
    ("api/ingest", "POST"): "telemetry from the ranks, authenticated by the attempt's own token, not a user's",
    ("api/checkpoints/pinned", "GET"): "a running attempt's retention asks with the attempt's own token",
    ("metrics", "GET"): "Prometheus' scrape: the metrics token or an allowed network (test_operator_metrics.py)",
}
# Of those, the routes that take an attempt's token and nothing else.
FOR_ATTEMPTS = [("api/ingest", "POST"), ("api/checkpoints/pinned", "GET")]

MATRIX = {
    # Pages.
    ("", "GET"): everyones(),
    ("runs/new/", "GET"): everyones(),
    ("runs/new/", "POST"): everyones(body={"name": "b's run"}),
    ("runs/compare/", "GET"): Ask(query="?runs={run_id}"),
    ("runs/<int:run_id>/", "GET"): Ask(),
    ("runs/<int:run_id>/lineage/", "GET"): Ask(),
    ("runs/<int:run_id>/triage/", "GET"): Ask(),
    ("nodes/", "GET"): everyones(),
    ("plan/", "GET"): everyones(),
    ("webhooks/", "GET"): everyones(),
    ("account/tokens/", "GET"): everyones(),
    ("account/tokens/", "POST"): everyones(body={"name": "b's token"}),
    ("account/tokens/<int:token_id>/revoke/", "POST"): Ask(),
    ("api/openapi.json", "GET"): everyones(),
    ("api/docs", "GET"): everyones(),
    # Runs.
    ("api/runs", "GET"): everyones(),
    ("api/runs", "POST"): everyones(body={"name": "b's run", "config": TINY_CONFIG}),
    ("api/runs/<run_id>", "GET"): Ask(),
    ("api/runs/<run_id>", "PATCH"): Ask(body={"name": "b's now", "tags": ["taken"], "archived": True}),
    ("api/runs/<run_id>/events", "GET"): Ask(),
    ("api/runs/<run_id>/cancel", "POST"): Ask(),
    ("api/runs/<run_id>/attempts/<number>/logs/<rank>", "GET"): Ask(),
    # The cluster's nodes are shared: anyone may see them (other users' ranks only as counts) and leave a
    # failing node out of launches.
    ("api/nodes", "GET"): everyones(),
    ("api/nodes/<name>/exclude", "POST"): everyones(body={"reason": "b says so"}),
    ("api/nodes/<name>/exclude", "DELETE"): everyones(),
    # Telemetry read back for the charts.
    ("api/runs/<run_id>/metrics/series", "GET"): Ask(),
    ("api/runs/<run_id>/metrics/ranks", "GET"): Ask(),
    ("api/runs/<run_id>/metrics/heatmap", "GET"): Ask(),
    ("api/runs/<run_id>/metrics/experts", "GET"): Ask(),
    ("api/runs/<run_id>/comm", "GET"): Ask(),
    # Checkpoints.
    ("api/runs/<run_id>/checkpoints", "GET"): Ask(),
    ("api/runs/<run_id>/checkpoints/<checkpoint_id>/pin", "POST"): Ask(),
    ("api/runs/<run_id>/checkpoints/<checkpoint_id>/unpin", "POST"): Ask(),
    ("api/runs/<run_id>/lineage", "GET"): Ask(),
    ("api/runs/<run_id>/resilience", "GET"): Ask(),
    ("api/runs/<run_id>/restore", "POST"): Ask(body={"checkpoint": "{checkpoint_id}"}),
    # Alerts and webhooks.
    ("api/runs/<run_id>/alerts", "GET"): Ask(),
    ("api/alerts/<alert_id>/acknowledge", "POST"): Ask(),
    ("api/alerts/<alert_id>/resolve", "POST"): Ask(),
    ("api/webhooks", "GET"): everyones(),
    # A webhook on A's run: refused as a field error, the run named as one that does not exist.
    ("api/webhooks", "POST"): Ask(body={"url": "http://93.184.215.14/hook", "run": "{run_id}"}, refused=(400,)),
    ("api/webhooks/<webhook_id>", "DELETE"): Ask(),
    # API tokens.
    ("api/tokens", "GET"): everyones(),
    ("api/tokens", "POST"): everyones(body={"name": "b's token"}),
    ("api/tokens/<token_id>", "DELETE"): Ask(),
    # The planner computes from what it is sent: nothing of anyone's.
    ("api/plan/catalog", "GET"): everyones(),
    ("api/plan/estimate", "POST"): everyones(body={}),
    ("api/plan/search", "POST"): everyones(body={}),
    ("api/plan/traffic", "POST"): everyones(body={}),
    ("api/plan/export", "POST"): everyones(body={}),
    # Datasets, imported models and checkpoint exports: each user's own.
    ("datasets/", "GET"): everyones(),
    ("datasets/<int:dataset_id>/", "GET"): Ask(),
    ("api/datasets", "GET"): everyones(),
    ("api/datasets", "POST"): everyones(body={"name": "b's dataset", "path": "/nowhere"}),
    ("api/datasets/<dataset_id>", "GET"): Ask(),
    ("api/models", "GET"): everyones(),
    ("api/models", "POST"): everyones(body={"name": "b's model", "path": "/nowhere"}),
    ("api/models/<model_id>", "GET"): Ask(),
    ("api/checkpoints/<checkpoint_id>/export", "POST"): Ask(body={}),
    ("api/exports", "GET"): everyones(),
    ("api/exports/<export_id>", "GET"): Ask(),
}

SOCKETS = {
    "ws/runs/<int:run_id>/": Ask(),
    # Each user hears only their own alerts: the group is the user's.
    "ws/alerts/": everyones(),
}


def _walk(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


def _methods(route: str, pattern) -> set[str]:
    """An API path's methods, from the operations ninja serves it with. A page does not say which it
    takes: those the matrix or the public list names, else GET."""
    code, cells = getattr(pattern.callback, "__code__", None), getattr(pattern.callback, "__closure__", None)
    closure = dict(zip(code.co_freevars, cells, strict=True)) if code and cells else {}
    path_view = closure["self"].cell_contents if "self" in closure else None
    if isinstance(path_view, PathView):
        return {method for operation in path_view.operations for method in operation.methods}
    return {method for named, method in {**MATRIX, **PUBLIC} if named == route} or {"GET"}


def served_routes() -> list[tuple[str, str]]:
    # A path with several operations is one URL pattern per operation, each serving them all.
    patterns = _walk(get_resolver().url_patterns)
    return sorted({(route, method) for route, pattern in patterns for method in _methods(route, pattern)})


SERVED = served_routes()


def socket_routes() -> list[str]:
    """The websocket routes of every app (its routing.py), as asgi.py serves them."""
    routes = []
    for app in pkgutil.iter_modules(loom.__path__):
        if app.ispkg and importlib.util.find_spec(f"loom.{app.name}.routing") is not None:
            routing = importlib.import_module(f"loom.{app.name}.routing")
            routes.extend(str(pattern.pattern) for pattern in routing.websocket_urlpatterns)
    return sorted(routes)


SOCKET_ROUTES = socket_routes()


def test_every_route_is_in_the_matrix():
    unexamined = [f"{method} /{route}" for route, method in SERVED if (route, method) not in {**MATRIX, **PUBLIC}]
    assert unexamined == [], "give each a row in MATRIX (who may ask it) or in PUBLIC (why anyone may)"
    assert set(SOCKET_ROUTES) == set(SOCKETS)


def test_the_matrix_names_only_routes_that_exist():
    served = set(SERVED)
    assert [key for key in {**MATRIX, **PUBLIC} if key not in served] == []
    assert not set(MATRIX) & set(PUBLIC)


@dataclass
class World:
    owner: object
    stranger: object
    stranger_token: str
    ids: dict

    def fill(self, text: str) -> str:
        """`text` with each <param> (a route's) and {param} (a query's or body's) replaced by A's object."""
        text = re.sub(r"<(?:\w+:)?(\w+)>", lambda match: str(self.ids[match.group(1)]), text)
        return re.sub(r"\{(\w+)\}", lambda match: str(self.ids[match.group(1)]), text)

    def body(self, ask: Ask) -> dict | None:
        if ask.body is None:
            return None
        filled = {}
        for field, value in ask.body.items():
            filled[field] = int(self.fill(value)) if isinstance(value, str) and value.startswith("{") else value
        return filled


@pytest.fixture
def world(platform_user, other_user, runs_dir):
    owner = platform_user[0]
    run, attempt, _ = claimed_run(owner, f"{MARK}-run")
    Run.objects.filter(pk=run.pk).update(note=f"{MARK}: the note")
    RunTag.objects.create(run=run, name=MARK)
    alert = Alert.objects.create(
        run=run,
        attempt=attempt,
        rule="straggler",
        rank=1,
        key="straggler:1",
        severity="warning",
        step=12,
        last_step=12,
        message=f"{MARK}: rank 1 is slow",
    )
    checkpoint = Checkpoint.objects.create(
        run=run,
        attempt=attempt,
        step=10,
        path=str(runs_dir / f"{MARK}-checkpoint" / "step-10"),
        layout=TINY_CONFIG["parallel"],
        world_size=2,
        committed_at=timezone.now(),
    )
    webhook = Webhook.objects.create(owner=owner, url=f"https://{MARK}-hook.invalid/alerts", run=run)
    create_api_token(owner, f"{MARK}-token")
    dataset = Dataset.objects.create(
        owner=owner,
        name=f"{MARK}-dataset",
        path=str(runs_dir / f"{MARK}-dataset"),
        vocab_size=257,
        tokenizer_kind="bytes",
        train_tokens=1000,
        validation_tokens=10,
        shards=2,
    )
    model = PretrainedModel.objects.create(owner=owner, name=f"{MARK}-model", source_path=f"/{MARK}/llama")
    export = CheckpointExport.objects.create(checkpoint=checkpoint, requested_by=owner, out_path=f"/{MARK}/export")
    ids = {
        "run_id": run.pk,
        "number": attempt.number,
        "rank": 0,
        "checkpoint_id": checkpoint.pk,
        "alert_id": alert.pk,
        "webhook_id": webhook.pk,
        "token_id": ApiToken.objects.get(user=owner).pk,
        "name": "node-of-a",
        "dataset_id": dataset.pk,
        "model_id": model.pk,
        "export_id": export.pk,
    }
    return World(owner, other_user, create_api_token(other_user, "b's own"), ids)


def owners_things(owner) -> str:
    """Everything of A's a request could change, as it stands."""
    rows = [
        *Run.objects.filter(owner=owner),
        *RunTag.objects.filter(run__owner=owner),
        *Attempt.objects.filter(run__owner=owner),
        *Alert.objects.filter(run__owner=owner),
        *Webhook.objects.filter(owner=owner),
        *Checkpoint.objects.filter(run__owner=owner),
        *Pin.objects.filter(checkpoint__run__owner=owner),
        *ApiToken.objects.filter(user=owner),
        *Dataset.objects.filter(owner=owner),
        *PretrainedModel.objects.filter(owner=owner),
        *CheckpointExport.objects.filter(requested_by=owner),
    ]
    return serializers.serialize("json", rows)


def logged_in(user, enforce_csrf=False) -> Client:
    client = Client(enforce_csrf_checks=enforce_csrf)
    client.force_login(user)
    return client


def send(client: Client, method: str, route: str, path: str, body: dict | None, token: str | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    if route.startswith("api/") and body is not None:
        return client.generic(method, path, json.dumps(body), content_type="application/json", **headers)
    if method == "POST":
        return client.post(path, body or {}, **headers)
    return client.generic(method, path, **headers)


def sends_to_login(answer) -> bool:
    return answer.status_code == 302 and answer["Location"].startswith("/login/")


def shows_nothing_of_the_owners(answer) -> bool:
    return MARK not in answer.content.decode(errors="replace")


EXAMINED = [key for key in SERVED if key not in PUBLIC]


@pytest.mark.parametrize("route, method", EXAMINED, ids=[f"{method} /{route}" for route, method in EXAMINED])
def test_a_route_serves_only_whom_it_should(route, method, world):
    ask = MATRIX.get((route, method))
    assert ask is not None, f"{method} /{route}: in neither MATRIX nor PUBLIC"
    path, body = "/" + world.fill(route) + world.fill(ask.query), world.body(ask)
    before = owners_things(world.owner)

    anonymous = send(Client(), method, route, path, body)
    assert anonymous.status_code in (401, 403) or sends_to_login(anonymous), anonymous.status_code
    assert shows_nothing_of_the_owners(anonymous)

    # CSRF is not enforced here: what refuses B must be whose the object is.
    by_session = send(logged_in(world.stranger), method, route, path, body)
    by_token = send(Client(), method, route, path, body, token=world.stranger_token)
    if not route.startswith("api/"):
        # A page is a browser's: an API token is no login there.
        assert sends_to_login(by_token)
    for stranger in [by_session] if not route.startswith("api/") else [by_session, by_token]:
        if ask.of_owner:
            assert stranger.status_code in ask.refused, (stranger.status_code, stranger.content[:300])
        else:
            assert stranger.status_code not in (401, 403) and stranger.status_code < 500, stranger.status_code
            assert not sends_to_login(stranger)
    assert shows_nothing_of_the_owners(by_session) and shows_nothing_of_the_owners(by_token)

    if method in UNSAFE:
        forged = send(logged_in(world.owner, enforce_csrf=True), method, route, path, body)
        assert forged.status_code == 403, forged.status_code

    assert owners_things(world.owner) == before
    own = send(logged_in(world.owner), method, route, path, body)
    assert own.status_code not in (401, 403, 404) and own.status_code < 500, (own.status_code, own.content[:300])
    assert not sends_to_login(own)


@pytest.mark.parametrize("route, method", FOR_ATTEMPTS)
def test_a_route_for_attempts_refuses_a_users_session_and_api_token(route, method, world, token_for):
    body = {"attempt": 1, "rank": 0, "seq": 0, "events": []} if method == "POST" else None
    by_session = send(logged_in(world.owner), method, route, "/" + route, body)
    by_token = send(Client(), method, route, "/" + route, body, token=token_for(world.owner))

    assert (by_session.status_code, by_token.status_code) == (401, 401)
    assert shows_nothing_of_the_owners(by_session) and shows_nothing_of_the_owners(by_token)


def open_socket(server, url: str, user=None, origin=None):
    headers = {"Cookie": f"sessionid={logged_in(user).cookies['sessionid'].value}"} if user is not None else {}
    return connect(url, origin=origin or server.url, additional_headers=headers, open_timeout=10)


def opens(server, url: str, user) -> bool:
    with open_socket(server, url, user):
        return True


def refused_status(server, url: str, user=None, origin=None) -> int:
    """A refused socket never opens: the handshake is answered with an HTTP error instead."""
    with pytest.raises(InvalidStatus) as refused:
        open_socket(server, url, user, origin)
    return refused.value.response.status_code


@pytest.mark.parametrize("route", SOCKET_ROUTES)
def test_a_websocket_opens_only_for_whom_it_should(route, world, platform_server):
    ask = SOCKETS[route]
    url = platform_server.url.replace("http://", "ws://") + "/" + world.fill(route)

    assert refused_status(platform_server, url) == 403
    # A page of another site cannot open it with the owner's cookie (the websocket's CSRF).
    assert refused_status(platform_server, url, world.owner, origin="https://elsewhere.example") == 403
    if ask.of_owner:
        assert refused_status(platform_server, url, world.stranger) == 403
    else:
        assert opens(platform_server, url, world.stranger)
    assert opens(platform_server, url, world.owner)
