"""What everything builds on: policies, dtype names, argument validation, caches, JAX compatibility."""
