"""The ``jmp-lite demo``: one Flax model, five precision configurations, the seeds' three claims.

Private: the command line (``jmp_lite.cli``) is the interface.
"""
