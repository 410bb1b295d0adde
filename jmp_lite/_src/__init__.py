"""The implementation of jmp_lite; import the public modules instead (``jmp_lite``, ``jmp_lite.flax``)."""
