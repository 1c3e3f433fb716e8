"""The torchtune-based trainer program (the `node` step of every tunepack runtime)."""
