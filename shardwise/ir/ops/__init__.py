"""shardwise's own ops, all in the ``torch.ops.shardwise`` namespace.

Each op module defines its ops with ``torch.library.custom_op("shardwise::name", ...)`` (a real
implementation), ``register_fake`` (the meta implementation), and registers its FLOP formula
with ``torch.utils.flop_counter.register_flop_formula`` and its bytes in ``ir/flops.py`` terms.
Importing this package registers every op.
"""

# isort: split
from shardwise.ir.ops import collective_matmul  # noqa: E402,F401  (all_gather_matmul, matmul_reduce_scatter)

from shardwise.ir.ops import norms  # noqa: E402,F401  (shardwise::rms_norm, add_rms_norm, add_rms_norm2)

# isort: split
from shardwise.ir.ops import segment  # noqa: E402,F401  (segment_set)
