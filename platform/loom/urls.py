from django.urls import include, path

from loom.api.urls import api

urlpatterns = [
    path("api/", api.urls),
    path("", include("loom.runs.page_urls")),
    path("", include("loom.planner.page_urls")),
    path("", include("loom.checkpoints.page_urls")),
    path("", include("loom.alerts.page_urls")),
    path("", include("loom.accounts.page_urls")),
    path("", include("loom.datasets.page_urls")),
]
