"""Gen PPL scores whole samples (the paper's code): a sample with EOD in its middle is decoded
whole, EOD dropped, and the judge scores every token of both documents; `cut_at_eod` keeps the
earlier first-document behaviour. Checked against a dense log-softmax of the judge's logits."""
import torch
import torch.nn.functional as F

from megatron_dllm.evaluation.gen_ppl import generative_perplexity
from megatron_dllm.evaluation.judge import Judge
from megatron_dllm.hf.configuration_dllm import DLLMConfig
from megatron_dllm.hf.modeling_dllm import DLLMForCausalLM
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
    config = DLLMConfig(family="ar", hidden_size=32, num_layers=1, num_heads=2, vocab_size=V, mask_token_id=MASK,
                        cond_dim=16, max_position_embeddings=64, attention="causal")
    torch.manual_seed(0)
    model = DLLMForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) * 0.2)
    return Judge(model.eval(), WordTokenizer(), 64, EOD, [MASK], {})


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
