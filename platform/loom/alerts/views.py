"""The triage and webhooks pages. Thin: triage.py and delivery_report.py gather, the templates show,
frontend/static/triage.js and webhooks.js act through the API."""

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse

from loom.runs import services as run_services
from loom.runs import states

from . import delivery_report, triage
from .models import Alert


@login_required
def run_triage(request, run_id: int):
    run = run_services.run_for(request.user, run_id)
    alerts = list(Alert.objects.filter(run=run).select_related("attempt"))
    rank_suspects, node_suspects = triage.suspects(alerts)
    query = request.GET.get("q", "").strip()
    undelivered, undelivered_total = delivery_report.undelivered(run)
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
        "undelivered": undelivered,
        "undelivered_total": undelivered_total,
        "webhook_tries": settings.LOOM_WEBHOOK_TRIES,
        "page": page,
    }
    return render(request, "alerts/triage.html", context)


@login_required
def webhook_list(request):
    """The user's webhooks, each with its latest deliveries and how many failed, and a form to add one."""
    page = {
        "urls": {
            "webhooks": reverse("api:create_webhook"),
            "webhook": reverse("api:delete_webhook", args=[0]),
        },
    }
    context = {
        "webhooks": delivery_report.webhooks_of(request.user),
        "runs": run_services.runs_for(request.user).only("id", "name"),
        "recent_deliveries": delivery_report.RECENT_DELIVERIES,
        "webhook_tries": settings.LOOM_WEBHOOK_TRIES,
        "page": page,
    }
    return render(request, "alerts/webhooks.html", context)
