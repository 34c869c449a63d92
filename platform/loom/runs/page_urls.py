from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.run_list, name="run-list"),
    path("runs/new/", views.new_run, name="run-new"),
    path("runs/compare/", views.run_compare, name="run-compare"),
    path("runs/<int:run_id>/", views.run_detail, name="run-detail"),
]
