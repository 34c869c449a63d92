from django.urls import path

from .consumers import UserAlertsConsumer

websocket_urlpatterns = [path("ws/alerts/", UserAlertsConsumer.as_asgi())]
