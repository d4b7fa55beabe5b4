"""Evaluation (as in the paper's code): validation NELBO/PPL, generative perplexity under a judge LM,
unigram entropy of samples, sampling throughput, zero-shot downstream tasks and GSM8K.
`tools/evaluate.py` is the command line.

    nelbo.py               the families' own bounds on a validation split, as the trainer computes them
    judge.py               loading a Hugging Face causal LM (directory or cached GGUF) as the judge
    gen_ppl.py             Gen PPL with first-EOS handling
    entropy.py             per-sample unigram entropy over the model's token ids
    samples.py             reading tools/sample.py output and plain text files
    throughput.py          tokens/s and samples/s of a sampler
    likelihood.py          log-likelihoods of continuations given contexts (the lm-eval scores)
    lm_eval_model.py       the lm-evaluation-harness model class
    generate_until.py      lm-eval's generate_until through the batched generators
    generation_batches.py  --batch-size N|auto for conditional generation
    offline_tasks.py       lm-eval tasks run from local files
    downstream.py          zero-shot downstream evaluation through lm-eval
    gsm8k.py               GSM8K accuracy and throughput
"""
