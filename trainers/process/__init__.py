"""The processes of a run: torchrun, the process group, CPU threads, compilation, log noise."""
