"""Evaluation (as in the paper's code): validation NELBO/PPL, generative perplexity under a judge LM,
unigram entropy of samples, and sampling throughput. `tools/evaluate.py` is the command line.

    nelbo.py       the families' own bounds on a validation split, as the trainer computes them
    judge.py       loading a Hugging Face causal LM (directory or cached GGUF) as the judge
    gen_ppl.py     Gen PPL with first-EOS handling
    entropy.py     per-sample unigram entropy over the model's token ids
    samples.py     reading tools/sample.py output and plain text files
    throughput.py  tokens/s and samples/s of a sampler
"""
