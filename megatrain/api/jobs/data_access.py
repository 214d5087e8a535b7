"""The data-access rule, as the API's submission checks import it: it lives in megatrain.data_access
so that megatrain.storage_scope (a job's storage key) applies the same rule without importing the API."""

from megatrain.data_access import (
    DataUrlError,
    allowed_roots,
    data_url_problem,
    data_urls,
    is_url,
    normalise_data_url,
    task_fields,
)

__all__ = [
    "DataUrlError",
    "allowed_roots",
    "data_url_problem",
    "data_urls",
    "is_url",
    "normalise_data_url",
    "task_fields",
]
