"""The run pages. Thin: services decide, templates show, frontend/static/run.js keeps the run page live."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Q
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse

from loom.alerts.detectors import CRITICAL
from loom.alerts.models import Alert
from loom.datasets.services import designer_sources
from trainer.config import RunConfig

from . import services, states
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


@login_required
def run_list(request):
    """Each run with how many of its alerts are live and how many of those are critical."""
    live = Q(alerts__state__in=Alert.LIVE)
    # Newest first, as the API lists them; ordered here because Django leaves Meta.ordering out of a
    # query that groups rows, and the alert counts group them.
    runs = (
        services.runs_for(request.user)
        .annotate(
            live_alerts=Count("alerts", filter=live),
            critical_alerts=Count("alerts", filter=live & Q(alerts__severity=CRITICAL)),
        )
        .order_by("-created_at", "-id")
    )
    return render(request, "runs/list.html", {"runs": runs})


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
