"""The Kubeflow SDK's ``train()`` options (``kubeflow.trainer.options``), re-exported unchanged.

On tunepack runtimes ``Name``, ``Labels``, ``Annotations``, ``ActiveDeadlineSeconds`` and
``RuntimePatch`` (with its patch types) set the TrainJob's fields; ``TrainerCommand`` and
``TrainerArgs`` are refused (tunepack's launcher and ``FineTune`` set them). Other runtimes take
them all, as in the SDK.

>>> from tunepack.options import Labels
>>> client.train(..., options=[Labels({"kueue.x-k8s.io/queue-name": "team-queue"})])
"""

from kubeflow.trainer.options import *  # noqa: F403
from kubeflow.trainer.options import __all__  # noqa: F401
