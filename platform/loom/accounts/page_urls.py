from django.urls import path

from . import views

urlpatterns = [
    path("account/tokens/", views.token_list, name="tokens"),
    path("account/tokens/<int:token_id>/revoke/", views.token_revoke, name="token-revoke"),
]
