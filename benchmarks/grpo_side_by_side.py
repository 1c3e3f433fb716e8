"""tunepack's GRPO (``method=grpo``) side by side with TRL's ``GRPOTrainer``, on one CPU workload.

    python benchmarks/grpo_side_by_side.py                 # 24 steps per trainer, one round
    python benchmarks/grpo_side_by_side.py --rounds 3      # interleaved rounds, medians
    python benchmarks/grpo_side_by_side.py --size smoke    # a few steps: checks the harness

Trainers (each a fresh process, ``--threads`` CPU threads (one), the same model, prompts, reward
and settings):

- ``tunepack``: tunepack's launcher, ``method=grpo`` over LoRA;
- ``trl``: TRL's ``GRPOTrainer`` + PEFT LoRA (``sbs_trl_grpo.py``), in TRL's virtual environment
  (``sbs_harness.trl_python``: ``trl[peft]`` under ``~/.cache/tunepack/bench/trl-<version>``,
  torch, transformers and peft from the project's environment).

Workload: tiny-llama3 (``tunepack tiny-model``) fine-tuned first so that it answers at all, as
tests/integration/test_grpo.py's ``answering_model`` does: tunepack's ``method=full`` on 256 sums
with their answers (``tiny_prompt_rows(256, seed=1)``), 4 epochs, batch 8, lr 3e-3; the trained
weights replace the tiny model's. It is prepared once and cached under
``~/.cache/tunepack/bench/grpo-<hash>/``, keyed by the tiny model's files, the rows and the
settings. Prompts: ``tiny_prompt_rows(256, seed=0)`` ("What is a plus b? Answer with the
number."). Reward: an even number, ``re.search('^[0-9]*[02468]$', answer)`` (tunepack's
``rewards=format reward_pattern=...``; in TRL a reward function doing the same). Per optimizer
step 8 prompts x 8 answers of at most 4 tokens, temperature 1, top_p 1, beta 0.04, epsilon 0.2,
lr 3e-3 cosine without warm-up, AdamW weight decay 0.01, LoRA r=8 alpha=16 dropout 0 on the
attention and MLP projections (tunepack's defaults for the tiny model), no gradient clipping,
fp32, no compilation.

Measurement: each trainer's process stamps the end of every optimizer step with its CPU time
and the wall clock (tunepack: around its recipe's ``_after_step``, in this script's child mode;
TRL: a ``TrainerCallback.on_step_end``). Optimizer steps per second and generated answer tokens
(end-of-turn token included, as both count them) per second are over the steps after
``--warmup``; per CPU second too, which a loaded machine disturbs less than the wall clock. Also
the process tree's CPU seconds and peak RSS (wait4) over the whole run and the mean reward over
the first 4 and the last 8 steps. Ratios are tunepack's throughput over TRL's (above 1: tunepack
faster). Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import runpy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sbs_harness import (  # noqa: E402
    RunDirs,
    add_run_arguments,
    chosen_systems,
    emit,
    log,
    measure,
    median_row,
    read_records,
    run_rounds,
    scratch,
    system_lines,
    trl_or_skipped,
)
from sbs_harness import versions as harness_versions  # noqa: E402
from sbs_workload import CACHE  # noqa: E402

SYSTEMS = ("tunepack", "trl")
BASELINE = "trl"  # ratios: tunepack's figures over TRL's
MODEL = "tiny-llama3"
FORMAT_VERSION = 1  # bump when the prepared model's recipe changes
# The answering model's fine-tuning (tests/integration/test_grpo.py's answering_model).
SFT_ARGS = ("method=full", "epochs=4", "batch_size=8", "lr=3e-3", "checkpoint_every_minutes=0")
SFT_ROWS = (256, 1)  # tiny_prompt_rows(rows, seed) with their answers
PROMPT_ROWS = (256, 0)
EVEN = "^[0-9]*[02468]$"
FIRST, LAST = 4, 8  # the reward means: over the first 4 and the last 8 steps


@dataclasses.dataclass
class Settings:
    steps: int
    warmup: int
    threads: int = 1
    batch_size: int = 8  # prompts per optimizer step
    num_generations: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.04
    epsilon: float = 0.2
    lr: float = 3e-3
    weight_decay: float = 0.01
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")
    reward_pattern: str = EVEN
    seed: int = 0


# ----------------------------------------------------------------------------- the workload
def _tree_digest(root: Path, pattern: str = "*") -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob(pattern) if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def tunepack_source() -> str:
    """A digest of the tunepack package's Python files as a trainer process will import them:
    runs of one report that differ here ran different code (a working tree being edited)."""
    import tunepack

    return _tree_digest(Path(tunepack.__file__).parent, "*.py")[:16]


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _initialize(ws: Path, data: Path, model_dir: Path, env: dict, logs: Path) -> None:
    for module, uri in (
        ("tunepack.initializers.dataset", data),
        ("tunepack.initializers.model", model_dir),
    ):
        run_env = {**env, "TUNEPACK_WORKSPACE": str(ws), "STORAGE_URI": f"file://{uri}"}
        measure([sys.executable, "-m", module], run_env, logs / f"{module.rsplit('.', 1)[1]}.log")


def base_env(threads: int) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "TUNEPACK_MODEL": MODEL,
    }
    for name in ("TUNEPACK_WORKSPACE", "STORAGE_URI", "TUNEPACK_BENCH_PROBE"):
        env.pop(name, None)
    return env


def prepare() -> tuple[Path, Path, str]:
    """The answering model's directory and the prompts' JSONL, made once and cached, and the
    cache key (a hash of the tiny model's files, the rows and the fine-tuning's settings)."""
    from tunepack.runtimes import catalog
    from tunepack.tiny import write_tiny_model
    from tunepack.tiny.dataset import tiny_prompt_rows

    sft_rows = _jsonl(
        [
            {"instruction": r["prompt"], "input": "", "output": r["answer"]}
            for r in tiny_prompt_rows(*SFT_ROWS)
        ]
    )
    prompts = _jsonl(tiny_prompt_rows(*PROMPT_ROWS))
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".grpo-", dir=CACHE))
    try:
        tiny = write_tiny_model(tmp / "tiny", catalog.get(MODEL))
        key_text = json.dumps([FORMAT_VERSION, _tree_digest(tiny), sft_rows, prompts, SFT_ARGS])
        key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
        root = CACHE / f"grpo-{key}"
        if (root / "done").is_file():
            return root / "model", root / "prompts.jsonl", key
        log(f"preparing the answering model ({' '.join(SFT_ARGS)}) in {root} ...")
        (tmp / "sft.jsonl").write_text(sft_rows, encoding="utf-8")
        env = base_env(1)
        ws = tmp / "ws"
        _initialize(ws, tmp / "sft.jsonl", tiny, env, tmp)
        measure(
            [sys.executable, "-m", "tunepack.trainers.launch", *SFT_ARGS],
            {**env, "TUNEPACK_WORKSPACE": str(ws)},
            tmp / "sft.log",
        )
        model = shutil.copytree(tiny, tmp / "model")
        (model / "model.safetensors").unlink()
        trained = ws / "output" / "model" / "model-00001-of-00001.safetensors"
        shutil.copy(trained, model / "model.safetensors")
        (tmp / "prompts.jsonl").write_text(prompts, encoding="utf-8")
        shutil.rmtree(ws)
        shutil.rmtree(tiny)
        (tmp / "done").write_text(json.dumps({"sft_args": SFT_ARGS, "sft_rows": SFT_ROWS}) + "\n")
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / "done").is_file():
                raise
        return root / "model", root / "prompts.jsonl", key
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- measurement
def stamped_launch(stamps: str, args: list[str]) -> None:
    """Child mode: tunepack's launcher in this process, the end of each optimizer step stamped
    (CPU time, wall clock) in ``stamps``, before the step's report."""
    from tunepack.trainers import recipe

    after_step = recipe.FineTuneRecipe._after_step

    def stamped(self, step, attempt):
        record = {"step": self.progress.step, "cpu_s": time.process_time()}
        record["wall_s"] = time.perf_counter()
        with open(stamps, "a") as out:
            out.write(json.dumps(record) + "\n")
        return after_step(self, step, attempt)

    recipe.FineTuneRecipe._after_step = stamped
    sys.argv = ["tunepack.trainers.launch", *args]
    runpy.run_module("tunepack.trainers.launch", run_name="__main__", alter_sys=True)


def window(stamps: list[dict], tokens: list[int], warmup: int) -> dict:
    """The steps after ``warmup``: from the stamp at the end of step ``warmup`` to the last one.
    ``tokens``: the answer tokens of each step (step 1 first)."""
    last = len(stamps)
    if last <= warmup or warmup < 1:
        return {"steps": 0, "cpu_s": 0.0, "wall_s": 0.0, "tokens": 0}
    start, end = stamps[warmup - 1], stamps[-1]
    return {
        "steps": last - warmup,
        "cpu_s": end["cpu_s"] - start["cpu_s"],
        "wall_s": end["wall_s"] - start["wall_s"],
        "tokens": sum(tokens[warmup:last]),
    }


def _per(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(name: str, per_step: list[dict], stamps: list[dict], settings, usage: dict) -> dict:
    """One run's figures from its steps (``reward``, ``tokens``, ``kl``, ``completion_length``),
    its step stamps and its process tree's usage."""
    note = None
    if len(stamps) != settings.steps or len(per_step) != settings.steps:
        note = f"{len(stamps)} stamps and {len(per_step)} logged steps for {settings.steps} steps"
    w = window(stamps, [s["tokens"] for s in per_step], settings.warmup)
    rewards = [s["reward"] for s in per_step]
    return {
        "system": name,
        "steps": len(per_step),
        "steady_steps": w["steps"],
        "steps_per_s": _per(w["steps"], w["wall_s"]),
        "steps_per_cpu_s": _per(w["steps"], w["cpu_s"]),
        "tokens_per_s": _per(w["tokens"], w["wall_s"]),
        "tokens_per_cpu_s": _per(w["tokens"], w["cpu_s"]),
        "steady_wall_s": w["wall_s"],
        "steady_cpu_s": w["cpu_s"],
        "answer_tokens": sum(s["tokens"] for s in per_step),
        "reward_first": _mean(rewards[:FIRST]),
        "reward_last": _mean(rewards[-LAST:]),
        "rewards": rewards,
        "kl_last": per_step[-1]["kl"] if per_step else None,
        "completion_length": _mean([s["completion_length"] for s in per_step]),
        "process_cpu_s": usage["cpu_s"],
        "process_wall_s": usage["wall_s"],
        "peak_rss_gib": usage["rss_gib"],
        "note": note,
    }


class Bench(RunDirs):
    def __init__(self, root: Path, settings: Settings, trl: Path | None) -> None:
        self.root, self.settings, self.trl = root, settings, trl
        self.model_dir, self.prompts, self.key = prepare()
        self.env = base_env(settings.threads)
        self.template = root / "ws-template"
        _initialize(self.template, self.prompts, self.model_dir, self.env, root)
        self.runs = 0
        self.tunepack_config: dict | None = None

    def run(self, name: str) -> dict:
        return getattr(self, "_" + name)(name)

    def tunepack_args(self) -> list[str]:
        s = self.settings
        return [
            "method=grpo",
            f"max_steps={s.steps}",
            f"batch_size={s.batch_size}",
            f"num_generations={s.num_generations}",
            f"max_new_tokens={s.max_new_tokens}",
            f"temperature={s.temperature}",
            f"top_p={s.top_p}",
            f"beta={s.beta}",
            f"epsilon={s.epsilon}",
            f"lr={s.lr}",
            f"weight_decay={s.weight_decay}",
            "warmup_steps=0",
            f"lora_rank={s.lora_rank}",
            f"lora_alpha={s.lora_alpha}",
            f"lora_dropout={s.lora_dropout}",
            f"seed={s.seed}",
            "rewards=format",
            f"reward_pattern={s.reward_pattern}",
            "device=cpu",
            "dtype=fp32",
            "compile=false",
            "activation_checkpointing=false",
            "checkpoint_every_minutes=0",
        ]

    def _tunepack(self, name: str) -> dict:
        import yaml

        run = self._run_dir(name)
        ws = run / "ws"
        ws.mkdir()
        for part in ("dataset", "model"):
            (ws / part).symlink_to(self.template / part)
        stamps = run / "stamps.jsonl"
        source = tunepack_source()
        cmd = [sys.executable, __file__, "--child-tunepack", stamps, *self.tunepack_args()]
        usage = measure(cmd, {**self.env, "TUNEPACK_WORKSPACE": str(ws)}, run / "train.log")
        lines = (ws / "output" / "metrics.jsonl").read_text().splitlines()
        steps = [m for m in map(json.loads, filter(None, lines)) if m.get("event") == "step"]
        if self.tunepack_config is None:
            self.tunepack_config = yaml.safe_load((ws / "output" / "config.yaml").read_text())
        per_step = [
            {
                "reward": m["reward_mean"],
                "tokens": m["tokens"],
                "kl": m["kl"],
                "completion_length": m["completion_length"],
            }
            for m in steps
        ]
        result = summarize(name, per_step, read_records(stamps), self.settings, usage)
        result["tunepack_source"] = source
        # The trainer's own clock, as a cross-check of the stamps: elapsed_s at each step's end.
        elapsed = [m["elapsed_s"] for m in steps]
        w = self.settings.warmup
        if len(elapsed) > w >= 1:
            result["steps_per_s_elapsed"] = _per(len(elapsed) - w, elapsed[-1] - elapsed[w - 1])
        result["peak_memory_gib_metrics"] = max((m["peak_memory_gib"] for m in steps), default=None)
        return result

    def _trl(self, name: str) -> dict:
        run = self._run_dir(name)
        settings = {
            **dataclasses.asdict(self.settings),
            "model_dir": str(self.model_dir),
            "prompts": str(self.prompts),
            "out": str(run / "out"),
        }
        (run / "settings.json").write_text(json.dumps(settings))
        env = {**self.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE)]))}
        env.pop("VIRTUAL_ENV", None)  # TRL's venv, not the project's
        cmd = [self.trl, HERE / "sbs_trl_grpo.py", run / "settings.json"]
        usage = measure(cmd, env, run / "train.log")
        out = json.loads((run / "out" / "result.json").read_text())
        logged = [e for e in out["log_history"] if "reward" in e]
        n = self.settings.batch_size * self.settings.num_generations
        per_step = [
            {
                "reward": e["reward"],
                # completions/mean_length: tokens per completion, its end-of-turn token included.
                "tokens": round(e["completions/mean_length"] * n),
                "kl": e.get("kl"),
                "completion_length": e["completions/mean_length"],
            }
            for e in logged
        ]
        result = summarize(name, per_step, out["stamps"], self.settings, usage)
        result["versions"], result["paths"] = out["versions"], out["paths"]
        result["resolved"] = out["resolved"]
        return result


# ----------------------------------------------------------------------------- report
FIGURES = (
    "steps_per_s",
    "steps_per_cpu_s",
    "tokens_per_s",
    "tokens_per_cpu_s",
    "peak_rss_gib",
    "process_cpu_s",
    "process_wall_s",
    "reward_first",
    "reward_last",
    "kl_last",
    "completion_length",
    "steady_steps",
)


def combine(rounds: list[dict[str, dict]], systems: list[str]) -> dict[str, dict]:
    """Per system: the median over rounds of every figure; then tunepack's over TRL's."""
    table = {}
    for name in systems:
        runs = [r[name] for r in rounds if name in r]
        table[name] = median_row(name, runs, FIGURES, per_round="steps_per_s")
    ratios = {}
    if "tunepack" in table and BASELINE in table:
        for key in ("steps_per_s", "steps_per_cpu_s", "tokens_per_s", "tokens_per_cpu_s"):
            a, b = table["tunepack"][key], table[BASELINE][key]
            ratios[key] = a / b if a and b else None
    return table, ratios


def versions(trl_runs: list[dict]) -> dict:
    packages = ("tunepack", "torch", "torchtune", "transformers", "peft")
    return harness_versions(trl_runs, packages, commit=True)


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def render(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"workload: {report['model']} answering model (grpo-{report['workload_key']}), "
        f"{s['batch_size']} prompts x {s['num_generations']} answers of <= "
        f"{s['max_new_tokens']} tokens per step, reward {s['reward_pattern']!r}, LoRA "
        f"r={s['lora_rank']} alpha={s['lora_alpha']:g}, {s['threads']} thread(s)",
        f"{s['steps']} steps per run, figures over the steps after {s['warmup']}; "
        f"{report['rounds']} interleaved round(s), medians; load average "
        f"{' '.join(f'{x:.2f}' for x in report['loadavg_before'])} before, "
        f"{' '.join(f'{x:.2f}' for x in report['loadavg_after'])} after "
        f"({report['cpu_count']} CPUs)",
        "",
        f"{'system':<10}{'steps/s':>9}{'steps/CPU-s':>13}{'tok/s':>9}{'tok/CPU-s':>11}"
        f"{'RSS GiB':>9}{'CPU s':>8}{'reward first4':>15}{'last8':>7}",
    ]
    lines += system_lines(
        report,
        10,
        lambda f: (
            f"{f('steps_per_s', '9.3f')}{f('steps_per_cpu_s', '13.3f')}"
            f"{f('tokens_per_s', '9.1f')}{f('tokens_per_cpu_s', '11.1f')}"
            f"{f('peak_rss_gib', '9.3f')}{f('process_cpu_s', '8.1f')}"
            f"{f('reward_first', '15.3f')}{f('reward_last', '7.3f')}"
        ),
    )
    r = report["ratio"]
    if r:
        lines.append(
            "tunepack / TRL: "
            + ", ".join(
                f"{k} {v:.2f}x" if v else f"{k} -"
                for k, v in (
                    ("steps/s", r["steps_per_s"]),
                    ("steps/CPU-s", r["steps_per_cpu_s"]),
                    ("tokens/s", r["tokens_per_s"]),
                )
            )
            + " (above 1: tunepack faster)"
        )
    sources = report["tunepack_sources"]
    if len(sources) > 1:
        lines.append(
            f"warning: tunepack's source changed between its runs ({len(sources)} different "
            "digests): the rounds ran different code"
        )
    v = report["versions"]
    lines.append(
        "versions: "
        + ", ".join(
            f"{k} {v[k]}" for k in ("tunepack", "torch", "torchtune", "transformers", "peft")
        )
        + (f", trl {v['trl_env']['trl']}" if "trl_env" in v else "")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("issue", "smoke"), default="issue")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (issue 24, smoke 3)")
    parser.add_argument("--warmup", type=int, help="steps left out of the rates (2; smoke 1)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    add_run_arguments(parser, SYSTEMS)
    args = parser.parse_args(argv)

    systems = chosen_systems(parser, args, SYSTEMS)
    smoke = args.size == "smoke"
    settings = Settings(
        steps=args.steps or (3 if smoke else 24),
        warmup=args.warmup if args.warmup is not None else (1 if smoke else 2),
        threads=args.threads,
    )
    if smoke:  # fewer, shorter generations: the same code paths in seconds
        settings.batch_size, settings.num_generations = 2, 4
    if not 1 <= settings.warmup < settings.steps:
        parser.error(f"--warmup must be from 1 to steps - 1 ({settings.steps - 1})")

    trl, skipped, systems = trl_or_skipped(systems, args, log)
    load_before = os.getloadavg()
    with scratch("tunepack-grpo-sbs-", args.keep) as root:
        bench = Bench(root, settings, trl)
        rounds = run_rounds(bench, systems, args.rounds, log)
        table, ratio = combine(rounds, systems)
        report = {
            "tool": "benchmarks/grpo_side_by_side.py",
            "mode": "cpu",
            "cpu_model": cpu_model(),
            "model": MODEL,
            "workload_key": bench.key,
            "settings": dataclasses.asdict(settings),
            "tunepack_args": bench.tunepack_args(),
            "tunepack_lora": (bench.tunepack_config or {}).get("model", {}),
            "rounds": args.rounds,
            "systems": table,
            "ratio": ratio,
            "runs": rounds,
            "skipped": skipped,
            "versions": versions([r["trl"] for r in rounds if "trl" in r]),
            "tunepack_sources": sorted(
                {r["tunepack"]["tunepack_source"] for r in rounds if "tunepack" in r}
            ),
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
            "cpu_count": os.cpu_count(),
        }
    emit(render(report), report, args.json)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child-tunepack":
        stamped_launch(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main())
