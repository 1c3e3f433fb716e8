"""Dataset and model initializer programs (the first steps of every tunepack runtime)."""
