import pytest
import torch.distributed as dist

from shardwise.mesh import destroy_world


@pytest.fixture
def one_process_group():
    """parallelize on a one-device mesh starts a group of one; leave none behind."""
    yield
    if dist.is_initialized():
        destroy_world()
