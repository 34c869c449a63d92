"""The Datasets pages. Thin: services decide; frontend/static/datasets.js sends the forms to the API."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import reverse

from . import services


@login_required
def dataset_list(request):
    """Your datasets and imported models, with forms to register and import more."""
    page = {
        "datasetsUrl": reverse("api:register_dataset"),
        "modelsUrl": reverse("api:import_model"),
        "modelUrl": reverse("api:model_detail", args=[0]),
    }
    context = {
        "datasets": services.datasets_for(request.user).prefetch_related("runs"),
        "models": services.models_for(request.user),
        "exports": services.exports_for(request.user)[:20],
        "roots": services.data_roots(),
        "page": page,
    }
    return render(request, "datasets/list.html", context)


@login_required
def dataset_detail(request, dataset_id: int):
    """One dataset: its counts, tokenizer, a few decoded training sequences and the runs that trained on it."""
    detail = services.dataset_detail(services.dataset_for(request.user, dataset_id))
    return render(request, "datasets/detail.html", {"dataset": detail})
