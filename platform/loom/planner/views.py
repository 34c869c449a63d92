"""The designer page. Thin: fields.py says what it asks for, frontend/static/design.js does the rest
through the planner API."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse

from loom.datasets.services import designer_sources

from .fields import STARTING_PRESET, design_sections
from .services import catalog


@login_required
def designer(request):
    page = {
        "catalog": catalog(),
        "preset": STARTING_PRESET,
        "sources": designer_sources(request.user),
        "urls": {
            "estimate": reverse("api:estimate"),
            "search": reverse("api:search"),
            "traffic": reverse("api:traffic"),
            "export": reverse("api:export"),
            "runs": reverse("api:create_run"),
        },
    }
    return render(request, "planner/designer.html", {"sections": design_sections(), "page": page})
