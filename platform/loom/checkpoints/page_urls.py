from django.urls import path

from . import views

urlpatterns = [
    path("runs/<int:run_id>/lineage/", views.lineage, name="run-lineage"),
]
