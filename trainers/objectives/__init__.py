"""What a step minimizes: the fused next-token loss and the preference and RL objectives."""
