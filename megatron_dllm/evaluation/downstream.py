"""Zero-shot downstream evaluation through lm-evaluation-harness, offline (`evaluate.py downstream`).

Runs `lm_eval.simple_evaluate` with this project's model class (`lm_eval_model.MegatronDLLM`)
on the offline tasks (`offline_tasks`), then writes lm-eval's results JSON and a markdown table
(acc and acc_norm with lm-eval's bootstrap standard errors, per task) beside it, both under a
temporary name renamed into place when complete. For diffusion families the table also gives
the mean Monte-Carlo standard error of the request scores. Progress: lm-eval's per-request bars.
"""
from __future__ import annotations

import json
import math
import os
import statistics

from megatron_dllm.result_files import write_result_file

METRICS = ("acc", "acc_norm")


def markdown_table(results: dict, mc_stderr: dict[str, float | None]) -> str:
    """| task | n | acc | acc_norm | MC stderr | from lm-eval's `results` and `n-samples`."""
    rows = ["| task | n | acc | acc_norm | mean MC stderr of ll |", "|---|---|---|---|---|"]
    for task, metrics in sorted(results["results"].items()):
        cells = []
        for metric in METRICS:
            value = metrics.get(f"{metric},none")
            err = metrics.get(f"{metric}_stderr,none")
            if value is None:
                cells.append("—")
            elif isinstance(err, (int, float)):
                cells.append(f"{100 * value:.2f} ± {100 * err:.2f}")
            else:
                cells.append(f"{100 * value:.2f}")
        n = results.get("n-samples", {}).get(task, {}).get("effective", "")
        se = mc_stderr.get(task)
        rows.append(f"| {task} | {n} | {cells[0]} | {cells[1]} | {'—' if se is None else f'{se:.4f}'} |")
    return "\n".join(rows) + "\n"


def run_downstream(lm, task_names: list[str], output_path: str, limit: float | None = None,
                   race_data: str | None = None, seed: int = 1234, bootstrap_iters: int = 1000) -> dict:
    """Evaluate `lm` (an lm-eval LM) on `task_names`; returns lm-eval's results (JSON-safe)."""
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from megatron_dllm.evaluation.offline_tasks import build_task

    tasks = [build_task(name, race_data) for name in task_names]
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=False,
                                      bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed)
    results = json.loads(json.dumps(results, default=handle_non_serializable))
    by_task = getattr(lm, "stderrs_by_task", {})
    # NaN (one Monte-Carlo sample has no spread) is no JSON: reported as None
    mc_stderr = {task: (statistics.fmean(v) if v and any(v) and not any(map(math.isnan, v)) else None)
                 for task, v in by_task.items()}
    results["megatron_dllm"] = {"mc_stderr_mean": mc_stderr, "limit": limit, "tasks": task_names}
    write_result_file(output_path, json.dumps(results, indent=2) + "\n")
    table = markdown_table(results, mc_stderr)
    write_result_file(os.path.splitext(output_path)[0] + ".md", table)
    return results
