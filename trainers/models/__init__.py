"""The model families tunepack builds on torchtune's parts, and their checkpoints' layouts."""
