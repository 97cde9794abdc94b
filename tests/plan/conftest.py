import pytest

from shardwise.ir.trace import trace_model
from shardwise.passes.pipeline import canonicalize


@pytest.fixture(scope="module")
def tiny_two_layers():
    """llama-tiny, two layers, batch 8 x 32, traced and canonicalised (once per module)."""
    tr = trace_model("llama-tiny", layers=2, batch=8, seq=32)
    canonicalize(tr)
    return tr
