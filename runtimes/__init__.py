"""ClusterTrainingRuntime definitions, generated from the model catalog."""
