from django.urls import path

from . import views

urlpatterns = [
    path("runs/<int:run_id>/triage/", views.run_triage, name="run-triage"),
    path("webhooks/", views.webhook_list, name="webhooks"),
]
