"""The triage page. Thin: triage.py gathers, the template shows, frontend/static/triage.js acts."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse

from loom.runs import services as run_services
from loom.runs import states

from . import triage
from .models import Alert


@login_required
def run_triage(request, run_id: int):
    run = run_services.run_for(request.user, run_id)
    alerts = list(Alert.objects.filter(run=run).select_related("attempt"))
    rank_suspects, node_suspects = triage.suspects(alerts)
    query = request.GET.get("q", "").strip()
    page = {
        "runId": run.pk,
        "urls": {
            "acknowledge": reverse("api:acknowledge", args=[0]),
            "resolve": reverse("api:resolve", args=[0]),
            "restore": reverse("api:restore", args=[run.pk]),
            "cancel": reverse("api:cancel_run", args=[run.pk]),
            "run": reverse("run-detail", args=[run.pk]),
            "series": reverse("api:metric_series", args=[run.pk]),
            "heatmap": reverse("api:rank_step_heatmap", args=[run.pk]),
        },
    }
    context = {
        "run": run,
        "timeline": triage.timeline(run, alerts),
        "rank_suspects": rank_suspects,
        "node_suspects": node_suspects,
        "alert_views": triage.alert_views(run, alerts),
        "live_alerts": sum(alert.state in Alert.LIVE for alert in alerts),
        "query": query,
        "hits": triage.search_logs(run, query) if query else None,
        "search_limit": triage.SEARCH_LIMIT,
        "cancellable": run.state in states.ACTIVE - {states.CANCELLING},
        "page": page,
    }
    return render(request, "alerts/triage.html", context)
