"""Job building: from what a user asks for to a checked TrainJob, whichever the entry point.

- ``trainjob``: ``TrainJobSpec``, the one typed record of everything a tunepack TrainJob says,
  and ``build_trainjob``, which checks it and writes the TrainJob (``tunepack render trainjob``
  fills the spec from its flags);
- ``submit``: the SDK's inputs (runtime, ``Initializer``, ``FineTune`` or ``BuiltinTrainer``,
  options) to a spec, with the trainer arguments and the memory plan checked; both backends'
  ``train()`` call it;
- ``translate``: the Kubeflow SDK's trainer and initializer types as tunepack's;
- ``naming``: the name each entry point gives a job, and the limits every TrainJob name meets.

Trainer arguments enter as strings in two places (the CLI's words, a spec given strings) and as
``FineTune`` fields in the SDK. Words are parsed once where they enter
(``trainjob.parse_trainer_args_for``: ``tunepack.trainers.args.parse_args``); a ``FineTune`` holds
its values parsed already, and ``submit.build`` only resolves them against the model
(``resolve_args``). Either way the spec holds ``TrainArgs``, which the TrainJob is written from.
"""
