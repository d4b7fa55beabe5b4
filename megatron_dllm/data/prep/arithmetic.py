"""A synthetic arithmetic task with checkable answers, for the CPU fine-tuning demonstration (not GSM8K).

Problems are additions a + b with 0 <= a < `max_operand` and 0 <= b < `max_second`; every (a, b)
pair appears once, and a seeded `test_size` of them is held out (never in the training split).
The reasoning (`--reasoning`) is either `columns`, the default: column by column from the units,
with the carry, e.g. 47 + 8 -> "7+8=15, 4+1=5" then "#### 55", each step a one-digit addition
next to the digits it reads; or `direct`: "47 + 8 = 55" then "#### 55". The training split is written in
Deng et al.'s GSM8K text format (`question||reasoning #### answer`, rendered by `sft_preprocess.py` as
"Question: ..." / "Answer: ... #### N"), the test split in the standard GSM8K JSONL format (`question`, `answer`
ending in `#### N`), so fine-tuning and scoring run exactly the GSM8K commands.

    python -m megatron_dllm.data.prep.arithmetic OUT_DIR [--max-operand 100] [--max-second 10] [--test-size 100]
        [--reasoning columns|direct]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.errors import InputError

REASONING = ("columns", "direct")


def column_steps(a: int, b: int) -> str:
    """Written addition from the units column: "7+8=15, 4+1=5" for 47 + 8 (the carry joins the next
    column; the last column's sum is written whole)."""
    steps, carry, column = [], 0, 0
    while a or b or column < 2:
        x, y = a % 10, b % 10 + carry
        steps.append(f"{x}+{y}={x + y}")
        carry, a, b, column = (x + y) // 10, a // 10, b // 10, column + 1
    return ", ".join(steps)


def problem(a: int, b: int, reasoning: str = "columns") -> tuple[str, str, str]:
    """(question, reasoning, answer)."""
    steps = column_steps(a, b) if reasoning == "columns" else f"{a} + {b} = {a + b}"
    return f"What is {a} plus {b}?", steps, str(a + b)


def write_task(out_dir: str, max_operand: int = 100, max_second: int = 10, test_size: int = 100,
               seed: int = 0, reasoning: str = "columns") -> dict:
    if reasoning not in REASONING:
        raise InputError(f"--reasoning {reasoning}: expected one of {', '.join(REASONING)}")
    pairs = [(a, b) for a in range(max_operand) for b in range(max_second)]
    if not 0 < test_size < len(pairs):
        raise InputError(f"--test-size {test_size}: expected 1..{len(pairs) - 1} ({len(pairs)} problems)")
    random.Random(seed).shuffle(pairs)
    test, train = pairs[:test_size], pairs[test_size:]
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.txt"), "test": os.path.join(out_dir, "test.jsonl")}
    with atomic_write(paths["train"]) as train_file, atomic_write(paths["test"]) as test_file:  # both or neither
        for a, b in train:
            q, r, ans = problem(a, b, reasoning)
            train_file.write(f"{q}||{r} #### {ans}\n")
        for a, b in test:
            q, r, ans = problem(a, b, reasoning)
            test_file.write(json.dumps({"question": q, "answer": f"{r}\n#### {ans}"}) + "\n")
    return {"train_problems": len(train), "test_problems": len(test), **paths}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--max-operand", type=int, default=100)
    p.add_argument("--max-second", type=int, default=10)
    p.add_argument("--test-size", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reasoning", choices=REASONING, default="columns")
    args = p.parse_args(argv)
    print(json.dumps(write_task(args.out_dir, args.max_operand, args.max_second, args.test_size, args.seed,
                                args.reasoning)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
