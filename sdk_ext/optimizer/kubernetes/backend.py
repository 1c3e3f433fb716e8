"""``KubernetesOptimizerBackend``: ``tunepack.OptimizerClient`` on a cluster, a Katib v1beta1
``Experiment`` whose trials are TrainJobs of a tunepack runtime, as the Kubeflow SDK's optimizer
makes it (``primaryContainerName: node``, ``retain: true``, Katib's default StdOut metrics
collector), with what the SDK cannot say of a tunepack trainer:

- each trial's values go into the TrainJob's ``spec.trainer.args`` (``lr=${trialParameters.lr}``),
  so the Trainer's admission checks every trial's arguments, and the trainer parses them;
- the objective is a metric the trainer prints as ``name=value`` for that collector
  (``methods.stdout_metrics``: ``eval_loss``, the method's own), and each metric's Katib value
  is its latest, the last line the trainer prints being result.json's own figures;
- the search is checked before anything is created (``template.prepare``): keys, values and
  metrics, and the largest point against the runtime's memory plan.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import datetime

from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.optimizer.types.algorithm_types import GridSearch, RandomSearch
from kubeflow.optimizer.types.optimization_types import Metric, Objective, TrialConfig
from kubeflow.optimizer.types.search_types import (
    CategoricalSearchSpace,
    ContinuousSearchSpace,
    Distribution,
)
from kubeflow.trainer.constants import constants as kc
from kubeflow.trainer.types import types as kf

from tunepack.backends.api_errors import api_message
from tunepack.core.errors import ConflictError, NotAvailableError, NotFoundError
from tunepack.optimizer import space as spaces
from tunepack.optimizer.base import COMPLETE, CREATED, FAILED, RUNNING, OptimizerBackend
from tunepack.optimizer.space import TPESearch
from tunepack.optimizer.template import Template, prepare, template_with
from tunepack.optimizer.types import (
    TRIAL_COMPLETE,
    TRIAL_FAILED,
    TRIAL_PRUNED,
    TRIAL_RUNNING,
    TRIAL_WAITING,
    OptimizationJob,
    Result,
    Trial,
)
from tunepack.runtimes import methods
from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK

GROUP, VERSION = "kubeflow.org", "v1beta1"
EXPERIMENTS, TRIALS = "experiments", "trials"
EXPERIMENT_LABEL = "katib.kubeflow.org/experiment"
# Katib injects its metrics collector only into pods of namespaces labelled so.
INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"
# The sidecar that runs the trainer's output through Katib's StdOut collector, and prints it.
COLLECTOR_CONTAINER = "metrics-logger-and-collector"
NAME_PREFIX = "hpo-"
PLACEHOLDER = "${{trialParameters.{}}}"
# The head klog puts on each line the collector prints (the trainer's lines among them).
_KLOG_HEAD = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.-]+:\d+\] ")


def katib_metric(metric: str) -> str:
    """A metric as the trainer prints it for Katib (``val_loss`` is ``eval_loss`` there)."""
    return methods.STDOUT_NAMES.get(metric, metric)


class KubernetesOptimizerBackend(OptimizerBackend):
    """Katib Experiments of tunepack TrainJobs in the config's namespace."""

    ENDED = frozenset({COMPLETE, FAILED})

    def __init__(
        self,
        cfg: KubernetesBackendConfig,
        gpu: str = DEFAULT_GPU,
        memory_check=DEFAULT_MEMORY_CHECK,
    ):
        from tunepack.backends.kubernetes import KubernetesBackend

        self.trainer = KubernetesBackend(cfg, gpu, memory_check)
        self.namespace = self.trainer.namespace
        self.custom_api = self.trainer.custom_api
        self.core_api = self.trainer.core_api
        self._kinds: dict[str, str] = {}  # each runtime's kind, as resolve_runtime found it

    # --- what the call asks, checked before anything is created --------------------------------

    def prepare(self, trial_template: object, **asked) -> tuple[Template, spaces.Space]:
        if asked.get("early_stopping") is not None:
            raise NotAvailableError(
                "early_stopping on a cluster (Katib's medianstop service) is not in this version "
                "of tunepack: search without it, or on this machine (LocalBackendConfig())"
            )

        def resolve(name: str) -> str:
            runtime = self.trainer.resolve_runtime(name)
            self._kinds[runtime.name] = runtime.kind.value
            return runtime.name

        return prepare(
            trial_template,
            **asked,
            resolve_runtime=resolve,
            check_job=lambda runtime, initializer, finetune: self._trainjob(
                runtime, initializer, finetune
            ),
        )

    def _trainjob(self, runtime: str, initializer, finetune) -> dict:
        from tunepack.jobs import submit

        return submit.build(
            runtime,
            initializer,
            finetune,
            name="trial",
            namespace=self.namespace,
            gpu=self.trainer.gpu,
            memory_check=self.trainer.memory_check,
            runtime_kind=self._kinds[runtime],
        )

    def experiment(self, name: str, template: Template, space: spaces.Space) -> dict:
        """The Experiment: each trial a TrainJob of the template with its values in place."""
        largest = template_with(
            template.finetune(), {p.name: p.largest() for p in space.parameters}
        )
        trainjob = self._trainjob(template.runtime, template.initializer(), largest)
        searched = [p.name for p in space.parameters]
        spec = trainjob["spec"]
        spec["trainer"]["args"] = with_placeholders(spec["trainer"]["args"], searched)
        # The initializers read the trainer's arguments too (to check the data against them).
        for step in (spec.get("initializer") or {}).values():
            for env in step.get("env") or []:
                if env["name"] == "TUNEPACK_TRAINER_ARGS":
                    env["value"] = json.dumps(with_placeholders(json.loads(env["value"]), searched))
        metadata = {k: v for k, v in trainjob["metadata"].items() if k not in ("name", "namespace")}
        goals = [katib_metric(g.metric) for g in space.goals]
        algorithm: dict = {"algorithmName": space.algorithm.name}
        if space.algorithm.seed is not None:
            algorithm["algorithmSettings"] = [
                {"name": "random_state", "value": str(space.algorithm.seed)}
            ]
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Experiment",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "objective": {
                    "type": space.goal.direction,
                    "objectiveMetricName": goals[0],
                    "additionalMetricNames": goals[1:],
                    # The latest value: the trainer prints result.json's figures last.
                    "metricStrategies": [{"name": g, "value": "latest"} for g in goals],
                },
                "algorithm": algorithm,
                "parallelTrialCount": space.parallel_trials,
                "maxTrialCount": space.num_trials,
                "parameters": [katib_parameter(p) for p in space.parameters],
                "trialTemplate": {
                    "retain": True,
                    "primaryContainerName": "node",
                    "trialParameters": [
                        {"name": n, "reference": n, "description": f"the trainer's {n}"}
                        for n in searched
                    ],
                    "trialSpec": {
                        "apiVersion": trainjob["apiVersion"],
                        "kind": trainjob["kind"],
                        **({"metadata": metadata} if metadata else {}),
                        "spec": spec,
                    },
                },
            },
        }
        if space.max_failed_trials is not None:
            body["spec"]["maxFailedTrialCount"] = space.max_failed_trials
        return body

    def submit(self, template: Template, space: spaces.Space) -> str:
        """Create the Experiment of a prepared search; returns its name."""
        self._check_namespace()
        name = NAME_PREFIX + uuid.uuid4().hex[:8]
        self.create(self.experiment(name, template, space))
        return name

    def _check_namespace(self) -> None:
        """Katib collects no metric from a trial in a namespace without its injection label;
        said before the Experiment is made (where this user may read namespaces)."""
        try:
            ns = self.core_api.read_namespace(self.namespace)
        except Exception:
            return  # no permission to read it: Katib's own events will say
        if (ns.metadata.labels or {}).get(INJECTION_LABEL) != "enabled":
            raise ConflictError(
                f"namespace {self.namespace!r} lacks the label {INJECTION_LABEL}=enabled, "
                "without which Katib collects no metric from the trials: kubectl label "
                f"namespace {self.namespace} {INJECTION_LABEL}=enabled"
            )

    def create(self, experiment: dict) -> None:
        name = experiment["metadata"]["name"]
        try:
            self.custom_api.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, EXPERIMENTS, experiment
            )
        except Exception as e:
            if getattr(e, "status", None) == 404:
                raise NotAvailableError(
                    "Katib is not installed in this cluster (no experiments.kubeflow.org/v1beta1):"
                    " install Katib v0.19 (docs/optimize.md) or search on this machine "
                    "(LocalBackendConfig())"
                ) from None
            reason = api_message(e)
            raise RuntimeError(
                f"Failed to create OptimizationJob: {self.namespace}/{name}"
                + (f": {reason}" if reason else "")
            ) from e

    # --- the jobs ------------------------------------------------------------------------------

    def _get(self, plural: str, name: str) -> dict:
        try:
            return self.custom_api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, name
            )
        except Exception as e:
            if getattr(e, "status", None) == 404:
                raise NotFoundError(
                    f"no OptimizationJob {name!r} in namespace {self.namespace}; see list_jobs()",
                    what="OptimizationJob",
                    name=name,
                ) from None
            raise RuntimeError(f"Failed to get OptimizationJob: {self.namespace}/{name}") from e

    def list_jobs(self) -> list[OptimizationJob]:
        try:
            items = self.custom_api.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, EXPERIMENTS
            )["items"]
        except Exception as e:
            raise RuntimeError(
                f"Failed to list OptimizationJobs in namespace: {self.namespace}"
            ) from e
        jobs = [self._job(raw) for raw in items]
        return sorted(jobs, key=lambda j: j.creation_timestamp)

    def get_job(self, name: str) -> OptimizationJob:
        return self._job(self._get(EXPERIMENTS, name))

    def _job(self, raw: dict) -> OptimizationJob:
        spec, status = raw["spec"], raw.get("status") or {}
        name = raw["metadata"]["name"]
        objective = spec["objective"]
        direction = objective["type"]
        metrics = [
            objective["objectiveMetricName"],
            *(objective.get("additionalMetricNames") or []),
        ]
        trials = self._trials(name, metrics[0])
        state, message = CREATED, None
        for c in status.get("conditions") or []:
            if c.get("status") != "True":
                continue
            if c["type"] == "Succeeded":
                state, message = COMPLETE, None
            elif c["type"] == "Failed":
                state, message = FAILED, c.get("message")
            elif c["type"] == "Running" and state == CREATED:
                state = RUNNING
        best = (status.get("currentOptimalTrial") or {}).get("bestTrialName") or None
        return OptimizationJob(
            name=name,
            search_space={p["name"]: _sdk_space(p) for p in spec.get("parameters") or []},
            objectives=[Objective(metric=m, direction=direction) for m in metrics],
            algorithm=_sdk_algorithm(spec.get("algorithm") or {}),
            trial_config=TrialConfig(
                num_trials=spec.get("maxTrialCount"),
                parallel_trials=spec.get("parallelTrialCount"),
                max_failed_trials=spec.get("maxFailedTrialCount"),
            ),
            trials=trials,
            creation_timestamp=_timestamp(raw["metadata"]["creationTimestamp"]),
            status=state,
            message=message,
            best_trial=best,
        )

    def _trials(self, name: str, objective: str) -> list[Trial]:
        try:
            items = self.custom_api.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, TRIALS, label_selector=f"{EXPERIMENT_LABEL}={name}"
            )["items"]
        except Exception as e:
            raise RuntimeError(f"Failed to list the trials of {self.namespace}/{name}") from e
        items.sort(key=lambda t: t["metadata"]["creationTimestamp"])
        return [self._trial(number, raw, objective) for number, raw in enumerate(items)]

    def _trial(self, number: int, raw: dict, objective: str) -> Trial:
        name = raw["metadata"]["name"]
        status = raw.get("status") or {}
        observed = (status.get("observation") or {}).get("metrics") or []
        metrics = [
            Metric(name=m["name"], min=m.get("min"), max=m.get("max"), latest=m.get("latest"))
            for m in observed
        ]
        state, message = _trial_state(status)
        try:
            trainjob = self.trainer.get_job(name)
        except Exception:
            trainjob = None  # not made yet, or deleted with its trial
        value = next((m.latest for m in metrics if m.name == objective), None)
        exit_code = getattr(trainjob, "exit_code", None) if state == TRIAL_FAILED else None
        return Trial(
            name=name,
            parameters={
                a["name"]: a["value"] for a in (raw["spec"].get("parameterAssignments") or [])
            },
            trainjob=trainjob,
            metrics=metrics,
            number=number,
            state=state,
            objective=_float(value) if state == TRIAL_COMPLETE else None,
            message=message,
            exit_code=exit_code,
        )

    def get_best_results(self, name: str) -> Result | None:
        best = self._get(EXPERIMENTS, name).get("status", {}).get("currentOptimalTrial") or {}
        if not best.get("bestTrialName"):
            return None
        return Result(
            parameters={a["name"]: a["value"] for a in best.get("parameterAssignments") or []},
            metrics=[
                Metric(name=m["name"], min=m.get("min"), max=m.get("max"), latest=m.get("latest"))
                for m in (best.get("observation") or {}).get("metrics") or []
            ],
            trial=best["bestTrialName"],
        )

    def trial_logs(self, trial: str, follow: bool) -> Iterator[str]:
        """What Katib's collector took from the trainer and printed (its klog heads off)."""
        pod = self._trainer_pod(trial)
        if pod is None:
            return iter(())
        lines = self.trainer._read_pod_logs(
            pod_name=pod, container_name=COLLECTOR_CONTAINER, follow=follow
        )
        return (_KLOG_HEAD.sub("", line) for line in lines)

    def _trainer_pod(self, trainjob: str) -> str | None:
        selector = (
            f"jobset.sigs.k8s.io/jobset-name={trainjob},"
            "jobset.sigs.k8s.io/replicatedjob-name=node,batch.kubernetes.io/job-completion-index=0"
        )
        pods = self.core_api.list_namespaced_pod(self.namespace, label_selector=selector).items
        pods.sort(key=lambda p: p.metadata.creation_timestamp)
        return pods[-1].metadata.name if pods else None

    def get_job_events(self, name: str) -> list[kf.Event]:
        job = self.get_job(name)
        involved = {name, *(t.name for t in job.trials)}
        try:
            items = self.core_api.list_namespaced_event(self.namespace).items
        except Exception as e:
            raise RuntimeError(f"Failed to list events in namespace: {self.namespace}") from e
        events = [
            kf.Event(
                involved_object_kind=e.involved_object.kind,
                involved_object_name=e.involved_object.name,
                message=e.message or "",
                reason=e.reason or "",
                event_time=e.first_timestamp,
            )
            for e in items
            if e.involved_object is not None
            and e.involved_object.kind in ("Experiment", "Trial", kc.TRAINJOB_KIND)
            and e.involved_object.name in involved
            and e.first_timestamp
        ]
        return sorted(events, key=lambda e: e.event_time)

    def delete_job(self, name: str) -> None:
        """Delete the Experiment; Kubernetes deletes its trials and their TrainJobs (each is
        owned by the one before)."""
        self._get(EXPERIMENTS, name)  # NotFoundError first
        try:
            self.custom_api.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, EXPERIMENTS, name, propagation_policy="Foreground"
            )
        except Exception as e:
            raise RuntimeError(f"Failed to delete OptimizationJob: {self.namespace}/{name}") from e


def with_placeholders(args: list[str], names: list[str]) -> list[str]:
    """The trainer's ``key=value`` arguments with each searched key's value a Katib trial
    parameter (added where the template leaves the key to its default)."""
    out = [a for a in args if a.partition("=")[0] not in names]
    return out + [f"{n}={PLACEHOLDER.format(n)}" for n in names]


def katib_parameter(p: spaces.Parameter) -> dict:
    """A searched argument as a Katib ParameterSpec (numbers spelled as the trainer takes them)."""
    if p.choices:
        return {
            "name": p.name,
            "parameterType": "categorical",
            "feasibleSpace": {"list": list(p.choices)},
        }
    low, high = (int(p.low), int(p.high)) if p.integer else (p.low, p.high)
    return {
        "name": p.name,
        "parameterType": "int" if p.integer else "double",
        "feasibleSpace": {
            "min": spaces.number(low),
            "max": spaces.number(high),
            "distribution": "logUniform" if p.log else "uniform",
        },
    }


def _trial_state(status: dict) -> tuple[str, str | None]:
    """A Katib trial's state in the words the local backend's trials use."""
    true = {
        c["type"]: c.get("message")
        for c in status.get("conditions") or []
        if c.get("status") == "True"
    }
    if "Succeeded" in true:
        return TRIAL_COMPLETE, None
    if "EarlyStopped" in true:
        return TRIAL_PRUNED, true["EarlyStopped"]
    for failed in ("Failed", "MetricsUnavailable", "Killed"):
        if failed in true:
            return TRIAL_FAILED, true[failed]
    if "Running" in true:
        return TRIAL_RUNNING, None
    return TRIAL_WAITING, None


def _sdk_space(p: dict):
    space = p.get("feasibleSpace") or {}
    if p.get("parameterType") in ("categorical", "discrete"):
        return CategoricalSearchSpace(choices=[str(v) for v in space.get("list") or []])
    kind = (
        Distribution.LOG_UNIFORM
        if space.get("distribution") == "logUniform"
        else Distribution.UNIFORM
    )
    return ContinuousSearchSpace(
        min=float(space["min"]), max=float(space["max"]), distribution=kind
    )


def _sdk_algorithm(spec: dict):
    settings = {s["name"]: s["value"] for s in spec.get("algorithmSettings") or []}
    seed = int(settings["random_state"]) if "random_state" in settings else None
    name = spec.get("algorithmName")
    if name == "grid":
        return GridSearch()
    if name == "tpe":
        return TPESearch(random_state=seed)
    return RandomSearch(random_state=seed)


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _timestamp(value) -> datetime:
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
