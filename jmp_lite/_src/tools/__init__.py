"""The opt-in tools: measurements, reports and the doctor, built on the core (``jmp_lite._src``) and
never imported by it. No training step depends on them."""
