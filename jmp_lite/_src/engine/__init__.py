"""The engine and its passes: ``transform``, the dtype decisions, the rewrites it runs per equation."""
