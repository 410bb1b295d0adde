"""The Flax front-ends and training state; public at ``jmp_lite.flax``."""
