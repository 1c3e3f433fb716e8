"""What a run leaves and reports: checkpoints, the result's files, progress, trackers."""
