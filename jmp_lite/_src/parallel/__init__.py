"""Multi-device training: sharded training (FSDP) and gradient reductions."""
