from django.contrib.auth import views as auth_views
from django.urls import path
from django.views.generic import RedirectView

from . import nodes_views, views

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.run_list, name="run-list"),
    # Every run page's address starts with it: cut back to it, it is the list.
    path("runs/", RedirectView.as_view(pattern_name="run-list")),
    path("runs/new/", views.new_run, name="run-new"),
    path("runs/compare/", views.run_compare, name="run-compare"),
    path("runs/<int:run_id>/", views.run_detail, name="run-detail"),
    path("nodes/", nodes_views.node_list, name="node-list"),
]
