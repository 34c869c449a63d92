from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "loom.telemetry"
