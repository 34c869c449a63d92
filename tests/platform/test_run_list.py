"""Run management through the API: GET /api/runs searched, filtered, sorted and paged by cursor, with the columns
a user scans read in a constant number of queries, and PATCH /api/runs/{id} renaming, tagging, noting and
archiving a run, all or nothing."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from loom.alerts.models import Alert
from loom.runs import states
from loom.runs.models import Run
from loom.runs.services import create_run, edit_run, move_attempt

from .helpers import TINY_CONFIG, BatchSender, claimed_run
from .test_api import api

pytestmark = pytest.mark.django_db


@pytest.fixture
def ada(platform_user):
    return platform_user[0]


@pytest.fixture
def token(ada, token_for):
    return token_for(ada)


def listed(client, token, query="", status=200):
    response = api(client, "get", f"/api/runs{query}", token)
    assert response.status_code == status, response.content
    return response.json()


def names(page) -> list[str]:
    return [run["name"] for run in page["runs"]]


def every_page(client, token, query, between_pages=lambda: None) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = listed(client, token, f"{query}&cursor={cursor}" if cursor else query)
        pages.append(names(page))
        between_pages()
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


def metric(step, **payload):
    return {"kind": "metric", "time": 100.0 + step, "step": step, "payload": payload}


def test_a_listed_run_carries_its_layout_progress_loss_throughput_duration_and_open_alerts(client, ada, token):
    config = {**TINY_CONFIG, "parallel": {"dp_replicate": 2, "tp": 2}, "steps": 40}
    run, attempt, _ = claimed_run(ada, "measured", config)
    move_attempt(attempt, states.RUNNING)
    sender = BatchSender(attempt)
    for rank in range(4):
        sender.send(rank, *[metric(step, loss_mean=4.0 - step / 10, tokens_per_s=1000.0 + step) for step in (1, 2, 3)])
    for key, severity in (("loss_spike", "critical"), ("straggler:1", "warning")):
        Alert.objects.create(run=run, attempt=attempt, rule=key, key=key, severity=severity, step=2, last_step=3,
                             message=key)  # fmt: skip
    Alert.objects.create(run=run, attempt=attempt, rule="old", key="old", severity="critical", step=1, last_step=1,
                         message="old", state=Alert.RESOLVED)  # fmt: skip
    create_run(ada, "fresh", TINY_CONFIG)

    page = listed(client, token)
    assert names(page) == ["fresh", "measured"]
    assert (page["next_cursor"], page["previous_cursor"]) == (None, None)
    fresh, measured = page["runs"]
    assert measured["layout"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 1, "cp": 1, "ep": 1}
    assert (measured["world_size"], measured["steps_done"], measured["steps_total"]) == (4, 3, 40)
    assert measured["last_loss"] == pytest.approx(3.7)
    # A rank's batch per second times the two data-parallel replicas, as the run page's chart counts it.
    assert measured["tokens_per_s"] == pytest.approx(2 * 1003.0)
    assert measured["duration_s"] >= 0
    assert (measured["open_alerts"], measured["critical_alerts"]) == (2, 1)
    assert (fresh["steps_done"], fresh["last_loss"], fresh["tokens_per_s"], fresh["duration_s"]) == (None,) * 4
    assert (fresh["world_size"], fresh["open_alerts"], fresh["tags"], fresh["note"], fresh["archived"]) == (
        2, 0, [], "", False,
    )  # fmt: skip


def test_search_state_and_tag_filters(client, ada, token):
    baseline = create_run(ada, "Llama baseline", TINY_CONFIG)
    sweep = create_run(ada, "lr 3e-4", TINY_CONFIG)
    create_run(ada, "other", TINY_CONFIG)
    edit_run(baseline, tags=["Reference"], note="the one to beat")
    edit_run(sweep, tags=["sweep", "lr"], note="after the BASELINE")
    cancelled, _, _ = claimed_run(ada, "stopped")
    Run.objects.filter(pk=cancelled.pk).update(state=states.CANCELLED)

    # In a name, a tag or a note, whatever the case.
    assert names(listed(client, token, "?search=baseline")) == ["lr 3e-4", "Llama baseline"]
    assert names(listed(client, token, "?search=REFER")) == ["Llama baseline"]
    assert names(listed(client, token, "?search=beat")) == ["Llama baseline"]
    assert names(listed(client, token, "?tag=sweep")) == ["lr 3e-4"]
    assert names(listed(client, token, "?tag=Reference")) == ["Llama baseline"]
    assert names(listed(client, token, "?state=cancelled")) == ["stopped"]
    assert names(listed(client, token, "?state=queued,cancelled&search=p")) == ["stopped", "lr 3e-4"]
    assert names(listed(client, token, "?state=running")) == []


def test_sorting_by_name_state_and_creation(client, ada, token):
    for name in ("beta", "Alpha", "gamma"):
        create_run(ada, name, TINY_CONFIG)
    started, _, _ = claimed_run(ada, "delta")
    assert names(listed(client, token)) == ["delta", "gamma", "Alpha", "beta"]
    assert names(listed(client, token, "?sort=created")) == ["beta", "Alpha", "gamma", "delta"]
    # Names sort whatever their case.
    assert names(listed(client, token, "?sort=name")) == ["Alpha", "beta", "delta", "gamma"]
    assert names(listed(client, token, "?sort=-name")) == ["gamma", "delta", "beta", "Alpha"]
    assert names(listed(client, token, "?sort=state"))[-1] == "delta"  # queued < starting
    edit_run(Run.objects.get(name="beta"), note="touched")
    assert names(listed(client, token, "?sort=-updated"))[0] == "beta"


@pytest.mark.parametrize("sort", ["-created", "created", "name", "-name", "state"])
def test_pages_neither_repeat_nor_skip_a_run_while_runs_are_created_between_them(client, ada, token, sort):
    originals = [create_run(ada, f"run {index:02d}", TINY_CONFIG).name for index in (7, 2, 5, 1, 6, 3, 4)]
    created = []

    def create_one():
        created.append(create_run(ada, f"run {len(created) + 3:02d}b", TINY_CONFIG).name)

    pages = every_page(client, token, f"?sort={sort}&limit=3", between_pages=create_one)
    seen = [name for page in pages for name in page]
    assert len(seen) == len(set(seen)), pages
    assert set(originals) <= set(seen), pages
    assert set(seen) <= set(originals) | set(created)
    assert all(len(page) <= 3 for page in pages)


def test_previous_cursor_leads_back_to_the_page_before(client, ada, token):
    for index in range(7):
        create_run(ada, f"run {index}", TINY_CONFIG)
    first = listed(client, token, "?limit=3")
    second = listed(client, token, f"?limit=3&cursor={first['next_cursor']}")
    third = listed(client, token, f"?limit=3&cursor={second['next_cursor']}")
    assert (names(first), names(second), names(third)) == (
        ["run 6", "run 5", "run 4"], ["run 3", "run 2", "run 1"], ["run 0"],
    )  # fmt: skip
    assert first["previous_cursor"] is None and third["next_cursor"] is None
    back = listed(client, token, f"?limit=3&cursor={third['previous_cursor']}")
    assert names(back) == names(second)
    start = listed(client, token, f"?limit=3&cursor={back['previous_cursor']}")
    assert names(start) == names(first) and start["previous_cursor"] is None
    assert names(listed(client, token, f"?limit=3&cursor={start['next_cursor']}")) == names(second)
    # Past the last run (archived meanwhile): an empty page that still leads back, to the runs before its cursor.
    edit_run(Run.objects.get(name="run 0"), archived=True)
    beyond = listed(client, token, f"?limit=3&cursor={second['next_cursor']}")
    assert (beyond["runs"], beyond["next_cursor"]) == ([], None)
    assert names(listed(client, token, f"?limit=3&cursor={beyond['previous_cursor']}")) == ["run 4", "run 3", "run 2"]


def test_bad_list_parameters_are_400_naming_each(client, ada, token):
    create_run(ada, "one", TINY_CONFIG)
    errors = listed(client, token, "?state=running,sleeping&sort=size&limit=0", status=400)["errors"]
    assert errors["state"].startswith("unknown states ['sleeping']; valid choices are ['queued'")
    assert errors["sort"].startswith("cannot sort by 'size'; valid choices are ['created', '-created'")
    assert errors["limit"] == "must be from 1 to 200 runs a page"
    assert "is not a cursor of this list" in listed(client, token, "?cursor=bm9wZQ", status=400)["errors"]["cursor"]
    by_name = listed(client, token, "?sort=name&limit=1")
    create_run(ada, "two", TINY_CONFIG)
    other_sort = listed(client, token, f"?cursor={listed(client, token, '?sort=name&limit=1')['next_cursor']}", 400)
    assert other_sort["errors"] == {"cursor": "was made for sort=name, not -created; ask again without a cursor"}
    assert by_name["next_cursor"] is None


def test_patch_renames_tags_notes_and_archives_and_a_bad_tag_changes_nothing(client, ada, token):
    run = create_run(ada, "before", TINY_CONFIG)
    url = f"/api/runs/{run.pk}"
    changed = api(client, "patch", url, token, {"name": " after ", "tags": ["Baseline", "lr:3e-4", "baseline"],
                                                "note": "first try\nwith warmup"})  # fmt: skip
    assert changed.status_code == 200, changed.content
    body = changed.json()
    assert (body["name"], body["tags"], body["note"], body["archived"]) == (
        "after", ["baseline", "lr:3e-4"], "first try\nwith warmup", False,
    )  # fmt: skip
    assert body["attempts"][0]["number"] == 1  # the run's detail, as GET answers it

    refused = api(client, "patch", url, token, {"name": "renamed", "tags": ["ok", "has space"], "note": "x"})
    assert refused.status_code == 400
    assert refused.json()["errors"] == {
        "tags": "'has space' is not a tag: a tag is 1 to 40 letters, digits and . _ : / - (kept in lower case, "
        "starting with a letter or digit), at most 20 a run"
    }
    too_many = api(client, "patch", url, token, {"tags": [f"t{index}" for index in range(21)]}).json()["errors"]
    assert too_many["tags"].startswith("21 tags are too many")
    blank = api(client, "patch", url, token, {"name": "  ", "archived": True, "colour": "red"})
    assert blank.status_code == 400 and blank.json()["errors"] == {"colour": "is not a known field"}
    assert api(client, "patch", url, token, {"name": "  ", "archived": True}).json()["errors"] == {
        "name": "is required"
    }
    run.refresh_from_db()
    assert (run.name, run.note, run.archived_at) == ("after", "first try\nwith warmup", None)
    assert sorted(run.tags.values_list("name", flat=True)) == ["baseline", "lr:3e-4"]

    # A field left out stays as it was; an empty list clears the tags.
    assert api(client, "patch", url, token, {"tags": []}).json()["tags"] == []
    assert api(client, "get", url, token).json()["note"] == "first try\nwith warmup"


def test_an_archived_run_leaves_the_list_and_comes_back(client, ada, token):
    kept, archived = create_run(ada, "kept", TINY_CONFIG), create_run(ada, "archived", TINY_CONFIG)
    answer = api(client, "patch", f"/api/runs/{archived.pk}", token, {"archived": True}).json()
    assert answer["archived"] is True and answer["archived_at"] is not None
    assert names(listed(client, token)) == ["kept"]
    assert names(listed(client, token, "?archived=true")) == ["archived"]
    # Still there to look at.
    assert api(client, "get", f"/api/runs/{archived.pk}", token).json()["archived"] is True
    api(client, "patch", f"/api/runs/{archived.pk}", token, {"archived": False})
    assert names(listed(client, token)) == ["archived", "kept"]
    assert kept.pk != archived.pk


def test_another_users_run_cannot_be_edited_nor_seen(client, ada, token, other_user, token_for):
    theirs = create_run(other_user, "theirs", TINY_CONFIG)
    edit_run(theirs, tags=["secret"])
    create_run(ada, "mine", TINY_CONFIG)
    patched = api(client, "patch", f"/api/runs/{theirs.pk}", token, {"name": "mine now", "archived": True})
    assert patched.status_code == 404 and patched.json() == {"errors": {"url": "no such run"}}
    assert api(client, "get", f"/api/runs/{theirs.pk}", token).status_code == 404
    assert names(listed(client, token, "?tag=secret")) == []
    assert names(listed(client, token)) == ["mine"]
    theirs.refresh_from_db()
    assert (theirs.name, theirs.archived_at) == ("theirs", None)
    assert names(listed(client, token_for(other_user))) == ["theirs"]


def test_the_list_reads_the_same_number_of_queries_for_two_runs_or_twelve(client, ada, token):
    def queries_to_list() -> tuple[int, int]:
        with CaptureQueriesContext(connection) as captured:
            page = listed(client, token, "?limit=50")
        return len(captured), len(page["runs"])

    def add_runs(count):
        for index in range(count):
            run, attempt, _ = claimed_run(ada, f"run {index}")
            BatchSender(attempt).send(0, metric(1, loss_mean=3.0, tokens_per_s=10.0))
            edit_run(run, tags=["a", f"t{index}"])
            Alert.objects.create(run=run, attempt=attempt, rule="r", key="r", severity="warning", step=1, last_step=1,
                                 message="m")  # fmt: skip

    add_runs(2)
    # The token's first use of the test records when it was used; later ones within the minute do not.
    queries_to_list()
    few, listed_few = queries_to_list()
    add_runs(10)
    many, listed_many = queries_to_list()
    assert (listed_few, listed_many) == (2, 12)
    assert few == many
