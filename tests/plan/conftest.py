import pytest

from shardwise.ir.trace import trace_model
from shardwise.mesh import parse_mesh
from shardwise.passes.pipeline import canonicalize
from tests.helpers import AC_BATCH, AC_LAYERS, AC_SEQ


@pytest.fixture(scope="module")
def tiny_two_layers():
    """llama-tiny, two layers, batch 8 x 32, traced and canonicalised (once per module)."""
    tr = trace_model("llama-tiny", layers=2, batch=8, seq=32)
    canonicalize(tr)
    return tr


@pytest.fixture(scope="module")
def tiny_four_layers():
    """llama-tiny, four layers, batch 8 x 256 (activations worth checkpointing), traced and
    canonicalised (once per module)."""
    tr = trace_model("llama-tiny", layers=AC_LAYERS, batch=AC_BATCH, seq=AC_SEQ)
    canonicalize(tr)
    return tr


@pytest.fixture(scope="module")
def mesh_of_two():
    """Two H100s in one mesh dim."""
    return parse_mesh("2", None, "h100")
