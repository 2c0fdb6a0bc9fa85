"""The statuses of refused imports (collm_aggregator.imports.import_status)."""

from __future__ import annotations

import pytest

from collm_aggregator.imports import import_status
from collm_common.adapter_io import AdapterAccessDenied, AdapterImportError, AdapterNotFound

pytestmark = pytest.mark.unit


def test_each_refusal_has_its_client_status() -> None:
    assert import_status(AdapterNotFound("the path does not exist")) == 404
    assert import_status(AdapterAccessDenied("adapter_config.json is not readable")) == 403
    assert import_status(AdapterImportError("DoRA adapters are not supported")) == 422
