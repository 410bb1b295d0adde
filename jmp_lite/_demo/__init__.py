"""The ``jmp-lite demo``: one Flax model, five precision configurations, three claims of
Micikevicius et al., 2018, "Mixed Precision Training".

Private: the command line (``jmp_lite.cli``) is the interface.
"""
