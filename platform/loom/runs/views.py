"""The run pages. Thin: services decide, templates show, frontend/static/run.js keeps the run page live."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse

from loom.datasets.services import designer_sources
from trainer.config import RunConfig

from . import listing, services, states
from .forms import NewRunForm, field_label, restore_inputs
from .hardware import warnings_for

# The run-level charts of the run and comparison pages: (element id, heading, the metrics API's series).
SERIES_CHARTS = [
    {"id": "loss-chart", "title": "Loss", "series": "loss"},
    {"id": "grad-norm-chart", "title": "Gradient norm", "series": "grad_norm"},
    {"id": "lr-chart", "title": "Learning rate", "series": "lr"},
    {"id": "tokens-chart", "title": "Tokens/s, all ranks", "series": "tokens_per_s"},
    {"id": "mfu-chart", "title": "MFU", "series": "mfu"},
]
# The comparison page's own: each run's validation loss on one chart (the run page draws it on the loss chart).
COMPARE_CHARTS = [
    *SERIES_CHARTS[:1],
    {"id": "eval-loss-chart", "title": "Validation loss", "series": "eval_loss"},
    *SERIES_CHARTS[1:],
]
COMPARE_RUNS_MAX = 8


# The run list's sort choices, as its form names them.
SORT_LABELS = {
    "-created": "newest first",
    "created": "oldest first",
    "-updated": "changed last",
    "name": "name, A to Z",
    "-name": "name, Z to A",
    "state": "state",
}


@login_required
def run_list(request):
    """The run list of the API (loom.runs.listing): search, state and tag filters, sort, pages by cursor and, behind
    a toggle, the archived runs. A bad parameter is shown above the list instead of runs."""
    asked = request.GET
    try:
        limit = int(asked.get("limit") or listing.LIMIT_DEFAULT)
    except ValueError:
        limit = 0
    try:
        query = listing.run_query(
            search=asked.get("search", ""),
            state=asked.get("state", ""),
            tag=asked.get("tag", ""),
            archived=asked.get("archived") == "true",
            sort=asked.get("sort") or listing.SORT_DEFAULT,
            limit=limit,
            cursor=asked.get("cursor", ""),
        )
    except services.RunInputError as error:
        context = {"errors": error.errors, "query": listing.RunQuery(), "asked": asked, "sorts": SORT_LABELS}
        return render(request, "runs/list.html", context | _filter_choices(request.user), status=400)
    page = listing.run_page(request.user, query)
    for run in page.runs:
        run.layout_text = layout_text(run.layout)
        run.duration_text = duration_text(run.duration_s)
    context = {
        "runs": page.runs,
        "query": query,
        "asked": asked,
        "sorts": SORT_LABELS,
        "next_url": _with_cursor(asked, page.next_cursor),
        "previous_url": _with_cursor(asked, page.previous_cursor),
        "filtered": bool(query.search or query.states or query.tag or query.cursor),
    }
    return render(request, "runs/list.html", context | _filter_choices(request.user))


def _filter_choices(user) -> dict:
    return {"states": list(states.TRANSITIONS), "tags": listing.tags_of(user)}


def _with_cursor(asked, cursor: str | None) -> str | None:
    if cursor is None:
        return None
    query = asked.copy()
    query["cursor"] = cursor
    return f"?{query.urlencode()}"


def layout_text(layout: dict[str, int]) -> str:
    """The degrees above 1, "dp_shard 2, tp 2"; "1 rank" where there is none."""
    return ", ".join(f"{degree} {size}" for degree, size in layout.items() if size > 1) or "1 rank"


def duration_text(seconds: float | None) -> str:
    """3h 05m, 4m 10s, 12s; empty for a run that has not started."""
    if seconds is None:
        return ""
    whole = int(seconds)
    hours, minutes, left = whole // 3600, whole // 60 % 60, whole % 60
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {left:02d}s" if minutes else f"{left}s"


@login_required
def new_run(request):
    # Each choice of starting weights' model section and each dataset's vocabulary, for the page to fill in.
    sources = designer_sources(request.user)
    if request.method != "POST":
        return render(request, "runs/new.html", {"form": NewRunForm(user=request.user), "sources": sources})
    form = NewRunForm(request.POST, user=request.user)
    try:
        run = services.create_run(request.user, *form.run_input())
    except services.RunInputError as error:
        form.add_input_errors(error.errors)
        return render(request, "runs/new.html", {"form": form, "sources": sources}, status=400)
    # The run is created all the same; its page shows these once.
    for key, message in warnings_for(run).items():
        messages.warning(request, f"{field_label(key)}: {message}")
    return redirect("run-detail", run_id=run.pk)


@login_required
def run_detail(request, run_id: int):
    run = services.run_for(request.user, run_id)
    latest = services.latest_attempt(run)
    config = RunConfig.model_validate(latest.config)
    page = {
        "state": run.state,
        "ranks": config.parallel.world_size,
        # More than 1: a mixture of experts, whose routing the Experts panel shows.
        "experts": config.model.experts,
        "attempt": latest.number,
        "runId": run.pk,
        "apiUrl": reverse("api:run_detail", args=[run.pk]),
        "urls": {
            "runList": reverse("run-list"),
            "checkpoints": reverse("api:run_checkpoints", args=[run.pk]),
            "resilience": reverse("api:run_resilience", args=[run.pk]),
            "restore": reverse("api:restore", args=[run.pk]),
            "exportCheckpoint": reverse("api:export_checkpoint", args=[0]),
            "exports": reverse("api:export_detail", args=[0]),
        },
        "socketPath": f"/ws/runs/{run.pk}/",
        "terminalStates": sorted(states.TERMINAL),
        "cancellableStates": sorted(states.ACTIVE - {states.CANCELLING}),
    }
    context = {
        "run": run,
        "attempts": run.attempts.select_related("restored_from"),
        "restore_inputs": restore_inputs(),
        "ranks": range(page["ranks"]),
        "cancellable": run.state in page["cancellableStates"],
        "page": page,
        "series_charts": SERIES_CHARTS,
    }
    return render(request, "runs/detail.html", context)


@login_required
def run_compare(request):
    """The run-level curves of several runs overlaid: ?runs=3,5 (or runs=3&runs=5, as the run list's
    checkboxes send it). Another user's run is a 404, as on its own page."""
    items = [item for value in request.GET.getlist("runs") for item in value.split(",") if item.strip()]
    try:
        ids = list(dict.fromkeys(int(item) for item in items))
    except ValueError:
        raise Http404("runs must be run ids") from None
    runs = [services.run_for(request.user, run_id) for run_id in ids[:COMPARE_RUNS_MAX]]
    page = {
        "runs": [
            {"id": run.pk, "name": run.name, "seriesUrl": reverse("api:metric_series", args=[run.pk])} for run in runs
        ],
    }
    context = {
        "runs": runs,
        "page": page,
        "series_charts": COMPARE_CHARTS,
        "left_out": len(ids) - len(runs),
        "runs_max": COMPARE_RUNS_MAX,
    }
    return render(request, "runs/compare.html", context)
