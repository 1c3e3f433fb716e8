"""Tools around training, each with its own command: the GPU memory planner (``planner``,
``tunepack plan``; job building uses it for the memory check), vLLM serving of a result
(``serving``, ``tunepack render serving``) and installing the runtimes on a cluster (``install``,
``tunepack install``)."""
