"""The lineage page. Thin: frontend/static/lineage.js draws it from the lineage API."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse

from loom.runs import services as run_services


@login_required
def lineage(request, run_id: int):
    run = run_services.run_for(request.user, run_id)
    page = {"run": run.pk, "apiUrl": reverse("api:run_lineage", args=[run.pk])}
    return render(request, "checkpoints/lineage.html", {"run": run, "page": page})
