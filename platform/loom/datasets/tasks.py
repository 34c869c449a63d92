"""Celery tasks that convert weights: they import torch, so only the worker loads trainer.hf."""

from celery import shared_task

from . import services


@shared_task(name=services.IMPORT_TASK, acks_late=False, ignore_result=True)
def import_model(model_id: int) -> None:
    """Convert a queued Hugging Face import into a loom checkpoint."""
    from trainer.hf.importing import import_model as convert

    services.convert_model(model_id, convert)


@shared_task(name=services.EXPORT_TASK, acks_late=False, ignore_result=True)
def export_checkpoint(export_id: int) -> None:
    """Write a queued checkpoint export in Hugging Face's format."""
    from trainer.hf.exporting import export_checkpoint as export

    services.run_export(export_id, export)
