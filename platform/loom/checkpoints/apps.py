from django.apps import AppConfig


class CheckpointsConfig(AppConfig):
    name = "loom.checkpoints"
