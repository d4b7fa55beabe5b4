"""Gen PPL scores whole samples (the paper's code): a sample with EOD in its middle is decoded
whole, EOD dropped, and the judge scores every token of both documents; `cut_at_eod` keeps the
earlier first-document behaviour. Checked against a dense log-softmax of the judge's logits."""
import torch
import torch.nn.functional as F

from megatron_dllm.evaluation.gen_ppl import generative_perplexity
from megatron_dllm.evaluation.judge import Judge
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.sampling import InferenceModel, decode

V, EOD, MASK = 40, 1, 39


class WordTokenizer:
    """Ids <-> space-separated numbers: both the model's tokenizer and the judge's."""
    eod = EOD

    def detokenize(self, ids):
        return " ".join(map(str, ids))

    def __call__(self, text):
        return {"input_ids": [int(w) for w in text.split()]}


def tiny_judge():
    return Judge(random_dense_model("ar", V, 64, num_layers=1), WordTokenizer(), 64, EOD, [MASK], {})


def dense_nll(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logits[:, MASK] = float("-inf")
    return -F.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_sample_with_eod_in_the_middle_is_scored_whole():
    first, second = [5, 9, 12, 7, 30], [8, 8, 21, 3, 17, 25, 11]
    row = torch.tensor([[EOD] + first + [EOD] + second + [EOD, EOD]])  # AR start token, 2 documents, tail
    inf = InferenceModel(None, "ar", MASK, V, 16, WordTokenizer(), "hf")
    whole, = decode(inf, row)
    cut, = decode(inf, row, cut_at_eod=True)
    assert whole == " ".join(map(str, first + second)) and cut == " ".join(map(str, first))

    judge = tiny_judge()
    res = generative_perplexity(judge, [whole])
    expected = dense_nll(judge.model, first + second)
    assert res.tokens == len(first + second) - 1  # every judged token of both documents
    torch.testing.assert_close(torch.tensor(res.nll, dtype=torch.float64), expected.mean(), rtol=1e-6, atol=0)
    old = generative_perplexity(judge, [cut])
    assert old.tokens == len(first) - 1

    # the paper's EOS counting when the judge's text holds EOS: non-EOS tokens plus the first EOS
    with_eos = first + [EOD] + second + [EOD, EOD]
    res = generative_perplexity(judge, [" ".join(map(str, with_eos))])
    nll = dense_nll(judge.model, with_eos)
    counted = torch.tensor([t != EOD for t in with_eos[1:]])
    counted[len(first) - 1] = True  # the first EOS (target index of with_eos[len(first)])
    assert res.tokens == int(counted.sum()) == len(first + second)
    torch.testing.assert_close(torch.tensor(res.nll, dtype=torch.float64), nll[counted].mean(), rtol=1e-6, atol=0)
