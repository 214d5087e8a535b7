"""The megatrain Python SDK (httpx only: importing it pulls in no torch, fastapi or sqlalchemy).

Usage: `with Client() as mt: job = mt.submit("spec.yaml"); print(mt.wait(job.id).status)`.
"""

from megatrain.client.client import Client, load_spec_file, read_credentials
from megatrain.client.datasets import DatasetFailed
from megatrain.client.download import DownloadError
from megatrain.client.errors import ApiError, ApiUnreachable, MegatrainError, SpecFileError
from megatrain.client.exports import ExportFailed
from megatrain.client.models import TERMINAL_STATUSES, Checkpoint, Dataset, Export, Job, LogLine, Sample
from megatrain.client.models_registry import RegisteredModel
from megatrain.client.samples import SampleFailed

__all__ = [
    "TERMINAL_STATUSES",
    "ApiError",
    "ApiUnreachable",
    "Checkpoint",
    "Client",
    "Dataset",
    "DatasetFailed",
    "DownloadError",
    "Export",
    "ExportFailed",
    "Job",
    "LogLine",
    "MegatrainError",
    "RegisteredModel",
    "Sample",
    "SampleFailed",
    "SpecFileError",
    "load_spec_file",
    "read_credentials",
]
