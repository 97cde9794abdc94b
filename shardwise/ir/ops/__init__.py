"""shardwise's own ops, all in the ``torch.ops.shardwise`` namespace.

Each op module defines its ops with ``torch.library.custom_op("shardwise::name", ...)`` (a real
implementation), ``register_fake`` (the meta implementation), and registers its FLOP formula
with ``torch.utils.flop_counter.register_flop_formula`` and its bytes in ``ir/flops.py`` terms.
Importing this package registers every op.
"""

from shardwise.ir.ops import attention, collective_matmul, norms, segment  # noqa: F401  (registers the ops)
