from django.urls import path

from . import views

urlpatterns = [
    path("plan/", views.designer, name="designer"),
]
