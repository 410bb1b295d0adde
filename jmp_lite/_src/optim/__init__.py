"""Loss scaling, the skip rule and low-precision optimizer state: the optax side of jmp_lite."""
