"""Operations with derivative rules of their own that the engine emits: float32-accumulating
contractions, the attention kernel, the fused cross-entropy."""
