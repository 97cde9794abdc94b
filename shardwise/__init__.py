from shardwise.ir.trace import Traced, trace, trace_model  # noqa: F401
