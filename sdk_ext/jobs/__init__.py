"""Job building: from what a user asks for to a checked TrainJob, whichever the entry point.

The modules: docs/architecture.md, "The SDK" (Job building); how trainer arguments are parsed
once at each door and travel typed: "Follow one argument"."""
