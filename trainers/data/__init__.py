"""The training rows: tokenization in the chat format, image rows, and the order of batches."""
