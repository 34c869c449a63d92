"""The run list: a user's runs searched, filtered and sorted, cut into pages by an opaque cursor, each run with
the columns a user scans (layout, progress, last loss, tokens/s, duration, open alerts, tags), read in the same
few queries however many runs a page holds.

A cursor names the last (or first) run of a page by its sort value and id, not by an offset, so a run created or
archived between two pages neither repeats a run on the next page nor skips one."""

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Exists, F, IntegerField, OuterRef, Prefetch, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce, Lower
from django.utils import timezone

from loom.alerts.detectors import CRITICAL
from loom.alerts.models import Alert
from loom.telemetry.models import RankStep
from trainer.config import world_size_of

from . import states
from .models import Attempt, Run, RunTag
from .services import RunInputError, runs_for

# What a list can be sorted by, each a column of the run; "-name" sorts the other way.
SORTS = {"created": F("created_at"), "updated": F("updated_at"), "name": Lower("name"), "state": F("state")}
SORT_DEFAULT = "-created"
LIMIT_DEFAULT = 50
LIMIT_MAX = 200
# The parallel degrees a listed run's layout shows.
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
DATETIME_SORTS = frozenset({"created", "updated"})


@dataclass(frozen=True)
class RunQuery:
    """What a run list asks for, checked: see `run_query`."""

    search: str = ""
    states: tuple[str, ...] = ()
    tag: str = ""
    archived: bool = False
    sort: str = SORT_DEFAULT
    limit: int = LIMIT_DEFAULT
    cursor: str = ""


@dataclass
class RunPage:
    runs: list[Run]
    # Null where there is nothing further that way.
    next_cursor: str | None
    previous_cursor: str | None


def run_query(
    search: str = "",
    state: str = "",
    tag: str = "",
    archived: bool = False,
    sort: str = SORT_DEFAULT,
    limit: int = LIMIT_DEFAULT,
    cursor: str = "",
) -> RunQuery:
    """The list's parameters as the API and the page take them (`state`: one or several, comma-separated), or
    RunInputError naming each bad one."""
    errors = {}
    wanted = tuple(dict.fromkeys(item.strip() for item in state.split(",") if item.strip()))
    unknown = [item for item in wanted if item not in states.TRANSITIONS]
    if unknown:
        errors["state"] = f"unknown states {unknown}; valid choices are {list(states.TRANSITIONS)}"
    if sort.removeprefix("-") not in SORTS:
        errors["sort"] = f"cannot sort by {sort!r}; valid choices are {sort_choices()}"
    if not 1 <= limit <= LIMIT_MAX:
        errors["limit"] = f"must be from 1 to {LIMIT_MAX} runs a page"
    query = RunQuery(search.strip(), wanted, tag.strip().lower(), archived, sort, limit, cursor)
    if cursor and "sort" not in errors:
        try:
            _decoded(query)
        except RunInputError as error:
            errors.update(error.errors)
    if errors:
        raise RunInputError(errors)
    return query


def sort_choices() -> list[str]:
    return [f"{sign}{name}" for name in SORTS for sign in ("", "-")]


def run_page(user, query: RunQuery) -> RunPage:
    """The page of the user's runs that `query` asks for, each with the list's columns (listed_columns)."""
    runs = _matching(runs_for(user), query).annotate(sort_value=SORTS[query.sort.removeprefix("-")])
    descending = query.sort.startswith("-")
    forward, key = _decoded(query) if query.cursor else (True, None)
    if key is not None:
        runs = runs.filter(_beyond(key, descending, forward))
    # Going back, the runs just before the cursor are the nearest ones in the opposite order.
    ascending = descending != forward
    order = ["sort_value", "id"] if ascending else ["-sort_value", "-id"]
    rows = list(_with_columns(runs.order_by(*order))[: query.limit + 1])
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    if not forward:
        rows.reverse()
    for run in rows:
        listed_columns(run)
    first, last = (_key(rows[0]), _key(rows[-1])) if rows else (key, key)
    # Forward, what lies back is the page the cursor came from; back, what lies forward is where it came from.
    further_back = more if not forward else key is not None
    further_on = more if forward else key is not None
    return RunPage(
        rows,
        next_cursor=_encoded(query.sort, "after", last) if further_on and last is not None else None,
        previous_cursor=_encoded(query.sort, "before", first) if further_back and first is not None else None,
    )


def _matching(runs: QuerySet, query: RunQuery) -> QuerySet:
    runs = runs.filter(archived_at__isnull=not query.archived)
    if query.states:
        runs = runs.filter(state__in=query.states)
    if query.tag:
        runs = runs.filter(Exists(RunTag.objects.filter(run=OuterRef("pk"), name=query.tag)))
    if query.search:
        tagged = Exists(RunTag.objects.filter(run=OuterRef("pk"), name__icontains=query.search))
        runs = runs.filter(Q(name__icontains=query.search) | Q(note__icontains=query.search) | tagged)
    return runs


def _with_columns(runs: QuerySet) -> QuerySet:
    """Each run's list columns as subqueries of the one query, and its tags and latest attempt prefetched: the
    same three queries for a page of 5 runs or 200."""
    latest_attempt = Attempt.objects.filter(run=OuterRef("pk")).order_by("-number").values("pk")[:1]
    # The latest attempt's steps, newest first, through the (attempt, step) index: the latest step of a run of
    # 1,024 ranks × 100,000 steps is one index lookup, not a scan of its rows.
    latest_steps = RankStep.objects.filter(attempt_id=OuterRef("latest_attempt_id")).order_by("-step", "rank")
    with_loss = latest_steps.filter(Q(loss_mean__isnull=False) | Q(loss__isnull=False))
    first_start = Attempt.objects.filter(run=OuterRef("pk"), started_at__isnull=False).order_by("started_at")
    live = Alert.objects.filter(run=OuterRef("pk"), state__in=Alert.LIVE)
    later = Attempt.objects.filter(run=OuterRef("run"), number__gt=OuterRef("number"))
    return runs.annotate(
        latest_attempt_id=Subquery(latest_attempt),
        steps_done=Subquery(latest_steps.values("step")[:1]),
        last_loss=Subquery(with_loss.values(value=Coalesce("loss_mean", "loss"))[:1]),
        rank_tokens_per_s=Subquery(latest_steps.filter(tokens_per_s__isnull=False).values("tokens_per_s")[:1]),
        first_started_at=Subquery(first_start.values("started_at")[:1]),
        open_alerts=_count(live),
        critical_alerts=_count(live.filter(severity=CRITICAL)),
    ).prefetch_related(
        "tags",
        Prefetch("attempts", queryset=Attempt.objects.filter(~Exists(later)), to_attr="latest_attempts"),
    )


def _count(rows: QuerySet) -> Coalesce:
    counted = rows.order_by().values("run").annotate(count=Count("pk")).values("count")
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def listed_columns(run: Run) -> None:
    """Set on a run of _with_columns what the list shows beside its name and state: its latest attempt's layout
    (the parallel degrees) and world size, steps done of its steps, last loss, tokens/s over all ranks (a rank's
    batch × the data-parallel degree, as the run page's chart), how long it has run (its first attempt's start
    to its latest attempt's end, or now while that runs)."""
    latest = run.latest_attempts[0] if run.latest_attempts else None
    config = latest.config if latest is not None else run.config
    parallel = config.get("parallel", {})
    run.layout = {degree: parallel.get(degree, 1) for degree in DEGREES}
    run.world_size = world_size_of(config)
    run.steps_total = config.get("steps")
    data_parallel = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    run.tokens_per_s = None if run.rank_tokens_per_s is None else run.rank_tokens_per_s * data_parallel
    end = latest.finished_at if latest is not None and latest.finished_at else timezone.now()
    run.duration_s = None if run.first_started_at is None else max(0.0, (end - run.first_started_at).total_seconds())


def tags_of(user) -> list[str]:
    """Every tag on the user's runs, once each, in order: the run list's tag filter offers them."""
    return list(RunTag.objects.filter(run__owner=user).values_list("name", flat=True).distinct().order_by("name"))


# ---- cursors ----


def _key(run: Run) -> list:
    return [run.sort_value, run.pk]


def _encoded(sort: str, direction: str, key: list) -> str:
    text = json.dumps({"sort": sort, direction: key}, separators=(",", ":"), default=datetime.isoformat)
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


NOT_A_CURSOR = "is not a cursor of this list: use a next_cursor or previous_cursor as given, or none for the first page"


def _decoded(query: RunQuery) -> tuple[bool, list]:
    """(forward, [sort value, run id]) of the query's cursor, made for the same sort, or RunInputError."""
    try:
        padded = query.cursor + "=" * (-len(query.cursor) % 4)
        document = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        direction = "after" if "after" in document else "before"
        value, run_id = document[direction]
        sort = document["sort"]
    except (ValueError, UnicodeError, binascii.Error, KeyError, TypeError):
        raise RunInputError({"cursor": NOT_A_CURSOR}) from None
    if sort != query.sort:
        raise RunInputError({"cursor": f"was made for sort={sort}, not {query.sort}; ask again without a cursor"})
    expected = str if sort.removeprefix("-") not in DATETIME_SORTS else datetime
    try:
        value = datetime.fromisoformat(value) if expected is datetime else value
    except (TypeError, ValueError):
        raise RunInputError({"cursor": NOT_A_CURSOR}) from None
    if not isinstance(value, expected) or isinstance(run_id, bool) or not isinstance(run_id, int):
        raise RunInputError({"cursor": NOT_A_CURSOR})
    return direction == "after", [value, run_id]


def _beyond(key: list, descending: bool, forward: bool) -> Q:
    """The runs past `key` in the list's order (forward) or before it (back), ties broken by id the same way."""
    value, run_id = key
    lookup = "gt" if descending != forward else "lt"
    return Q(**{f"sort_value__{lookup}": value}) | Q(sort_value=value, **{f"id__{lookup}": run_id})
