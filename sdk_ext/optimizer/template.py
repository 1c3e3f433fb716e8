"""The trial template and the search as a backend gets them: parsed once, checked before
anything is created (``prepare``), held as plain data (``Template``) from which each trial's
``FineTune`` is made (``template_with``). The same for the local backend and the cluster's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kubeflow.optimizer.types.optimization_types import Objective, TrialConfig
from kubeflow.trainer.types import types as kf

from tunepack.core.errors import BadValueError, ConflictError, UnsupportedError
from tunepack.optimizer import space as spaces
from tunepack.optimizer.space import SDK, MedianStop, Spelling
from tunepack.runtimes import methods


@dataclass
class Template:
    """The trial template as plain data: the runtime, the FineTune's arguments and placement,
    the initializer's sources."""

    runtime: str
    args: list[str]
    placement: dict
    dataset: str
    model: str
    initializer_env: dict

    def finetune(self, **values):
        from tunepack.finetune import FineTune

        base = FineTune.from_args(self.args, **self.placement)
        return dataclasses.replace(base, **values) if values else base

    def initializer(self):
        from tunepack.jobs.translate import Initializer

        return Initializer(dataset=self.dataset, model=self.model, env=dict(self.initializer_env))


def prepare(
    trial_template: object,
    *,
    search_space: object,
    trial_config: TrialConfig | None = None,
    objectives: list[Objective] | None = None,
    algorithm: object = None,
    early_stopping: MedianStop | None = None,
    spelling: Spelling = SDK,
    resolve_runtime: Callable[[str], str],
    check_job: Callable[[str, object, object], object],
) -> tuple[Template, spaces.Space]:
    """The trial template and the search, parsed and checked: every key, bound and choice
    by the trainer's vocabulary, each metric against the method, the largest point against
    the memory plan. Raises ``BadInputError`` (one line) before anything is created.

    ``resolve_runtime(name)`` is the backend's runtime of that name (its name); ``check_job(runtime,
    initializer, finetune)`` builds the backend's job of the largest point, refusing it as a job
    submitted there would be."""
    from tunepack.jobs.translate import storage_uri, to_finetune, to_initializer

    if not isinstance(trial_template, kf.TrainJobTemplate):
        raise BadValueError(
            "trial_template must be TrainJobTemplate(runtime='tunepack-...', "
            f"trainer=FineTune(...), initializer=Initializer(...)), got {trial_template!r}"
        )
    runtime = trial_template.runtime
    runtime = runtime.name if isinstance(runtime, kf.Runtime) else runtime
    if not isinstance(runtime, str) or not runtime:
        raise BadValueError("TrainJobTemplate.runtime: name a tunepack runtime")
    runtime = resolve_runtime(runtime)
    finetune = to_finetune(trial_template.trainer)
    initializer = to_initializer(trial_template.initializer)
    parameters = spaces.parse_space(search_space, spelling)
    config = trial_config or TrialConfig()
    for field in ("num_trials", "parallel_trials"):
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            shown = spelling.trials if field == "num_trials" else f"TrialConfig.{field}"
            raise BadValueError(spaces.invalid_count_message(shown, value))
    failed = config.max_failed_trials
    if failed is not None and (not isinstance(failed, int) or failed < 0):
        raise BadValueError(
            f"TrialConfig.max_failed_trials={failed!r} is not valid: expected an integer >= 0"
        )
    chosen = spaces.parse_algorithm(algorithm, parameters, spelling)
    # The metrics every trial reports: the methods the search can draw, the template's
    # validation rows and rewards.
    drawn = next((p.choices for p in parameters if p.name == "method"), None)
    method_names = drawn or (finetune.method or methods.DEFAULT,)
    rewards = tuple(w.name for w in (finetune.parsed_args().values.get("rewards") or ()))
    if not rewards:
        from tunepack.runtimes import reward_names

        rewards = (reward_names.DEFAULT,)
    validates = bool(finetune.val_fraction)
    goals = None
    for name in method_names:
        method = methods.get(name)
        goals = spaces.parse_objectives(
            objectives, method, validates and method.validates, rewards, spelling
        )
    if early_stopping is not None:
        if not isinstance(early_stopping, MedianStop):
            raise UnsupportedError(
                f"early_stopping={early_stopping!r}: tunepack stops trials early by the "
                "median rule, MedianStop(min_trials_required=3, start_step=0)"
            )
        if goals[0].metric == spaces.VAL_LOSS and not finetune.eval_every_steps:
            raise ConflictError(
                "early_stopping: MedianStop compares trials at their evaluations, but the "
                "trial template evaluates only at the end: set eval_every_steps (e.g. "
                "FineTune(eval_every_steps=10))"
            )
    num_trials = config.num_trials
    if chosen.name == "grid":
        num_trials = min(num_trials, spaces.grid_size(parameters))
    space = spaces.Space(
        parameters, goals, chosen, early_stopping, num_trials, config.parallel_trials, failed
    )
    # Every value a trial can draw, each with the template's other values, as FineTune
    # takes it; the largest point (the most memory) through the job's own checks.
    for p in parameters:
        for raw in p.choices or (spaces.number(p.low), spaces.number(p.high)):
            value = raw if not p.integer or p.choices else str(int(float(raw)))
            try:
                template_with(finetune, {p.name: value})
            except BadValueError as err:
                raise BadValueError(f"{spelling.key(p.name)}: {err}") from None
    largest = template_with(finetune, {p.name: p.largest() for p in parameters})
    check_job(runtime, initializer, largest)
    template = Template(
        runtime=runtime,
        args=finetune.to_args(),
        placement={
            k: getattr(finetune, k)
            for k in ("num_nodes", "num_proc_per_node", "resources_per_node", "env")
            if getattr(finetune, k) is not None
        },
        dataset=storage_uri(initializer.dataset, "dataset"),
        model=storage_uri(initializer.model, "model"),
        initializer_env=dict(initializer.env or {}),
    )
    return template, space


def template_with(finetune, values: dict[str, str]):
    """The template's FineTune with ``values`` (trainer arguments as spelled) in place."""
    return dataclasses.replace(finetune, **{k: spaces.typed(k, v) for k, v in values.items()})
