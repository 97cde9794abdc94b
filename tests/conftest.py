import pytest

from tests.helpers import HF_TINY


@pytest.fixture
def hf_tiny_config():
    """Path of the tiny Llama ``config.json`` (use as ``hf:{path}``)."""
    return HF_TINY["llama"]
