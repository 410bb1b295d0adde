"""The plain-JAX front-end (``autocast``) and what the front-ends share for fp8 weights."""
