"""fp8 recipes, state and contractions (current, delayed and block scaling)."""
