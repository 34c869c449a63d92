from django.urls import include, path

from loom.api.urls import api
from loom.operations.views import metrics

urlpatterns = [
    path("api/", api.urls),
    path("metrics", metrics),
    path("", include("loom.runs.page_urls")),
    path("", include("loom.planner.page_urls")),
    path("", include("loom.checkpoints.page_urls")),
    path("", include("loom.alerts.page_urls")),
    path("", include("loom.accounts.page_urls")),
    path("", include("loom.datasets.page_urls")),
]
