"""Hugging Face export/import (tools/convert_to_hf.py, tools/convert_from_hf.py): for every family
the exported transformers model reproduces the megatron model's logits (fp32), including Eso-LM's
permuted positions and Duo's non-zero sigma; AR generates; the tokenizer knows [MASK]; HF ->
megatron (TP=2) -> HF is bit-exact, and training starts from the converted checkpoint. The Eso-LM
checkpoint is trained at TP=2 (sharded), the AR one at PP=2 with 2 virtual stages (interleaved)."""
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO, launch_env, run_pretrain, run_python

pytestmark = pytest.mark.slow

FAMILIES = ["ar", "mdlm", "duo", "esolm", "bd3lm"]
FAMILY_FLAGS = {"bd3lm": ["--block-size", "4"]}
RUN = ["--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--train-iters", "2", "--lr", "1e-2", "--lr-warmup-iters", "0", "--eval-interval", "100"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def checkpoints(demo_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_ckpts")
    layouts = {"esolm": ["--tensor-model-parallel-size", "2"],  # sharded over TP
               "ar": ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                      "--num-layers", "4"]}  # interleaved pipeline chunks

    def train(family):
        layout = layouts.get(family, [])
        work = root / family
        work.mkdir()
        run_pretrain(2 if layout else 1, ["--demo-cache-dir", demo_cache, "--family", family,
                                          *FAMILY_FLAGS.get(family, []), *RUN, *layout,
                                          "--save", str(work / "ckpt"), "--tensorboard-dir", str(work / "tb")], work)
        return family, str(work / "ckpt")

    with ThreadPoolExecutor(len(FAMILIES)) as pool:  # separate processes: train concurrently (the
        return dict(pool.map(train, FAMILIES))  # one-process runs leave a core idle, as do start-ups)


def _run(argv, timeout=300, nproc=1):
    proc = run_python(argv, REPO, {**ENV, **launch_env(nproc)}, timeout, nproc)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_export_matches_megatron_for_every_family(checkpoints, demo_cache, tmp_path):
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    tok = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    args = [f"{f}={checkpoints[f]}" for f in FAMILIES]
    proc = _run([__file__, "compare", str(tmp_path), tok, *args])
    for family in FAMILIES + ["overwrite"]:
        assert f"OK {family}" in proc.stdout, proc.stdout


@pytest.mark.multiprocess
def test_round_trip_hf_megatron_tp2_hf_is_exact(checkpoints, demo_cache, tmp_path, capsys):
    from safetensors.torch import load_file

    hf1, ckpt, hf2 = tmp_path / "hf1", tmp_path / "ckpt_tp2", tmp_path / "hf2"
    _run([os.path.join(REPO, "tools", "convert_to_hf.py"), "--load", checkpoints["mdlm"],
          "--out", str(hf1)])
    back = _run([os.path.join(REPO, "tools", "convert_from_hf.py"), "--hf", str(hf1), "--save", str(ckpt),
                 "--tensor-model-parallel-size", "2"], nproc=2)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert back.stderr.count("note: the checkpoint records no tokenizer (tokenizer.model, tokenizer.json in --hf") == 1
    # converting into a directory that holds a checkpoint (a training run's, say) is refused
    from megatron_dllm.checkpoint import manifest
    from megatron_dllm.cli import convert_from_hf

    trained = checkpoints["mdlm"]
    before = {n: manifest.sha256(os.path.join(trained, "iter_0000002", n))
              for n in os.listdir(os.path.join(trained, "iter_0000002"))}
    assert convert_from_hf.main(["--hf", str(hf1), "--save", trained]) == 2
    assert (f"error: --save {trained} already holds a checkpoint; pass --overwrite to replace it"
            in capsys.readouterr().err)
    assert before == {n: manifest.sha256(os.path.join(trained, "iter_0000002", n)) for n in before}
    assert open(os.path.join(trained, "latest_checkpointed_iteration.txt")).read() == "2"
    for bad, message in [(tmp_path / "nothing", "config.json not found"), (ckpt, "config.json not found")]:
        assert convert_from_hf.main(["--hf", str(bad), "--save", str(tmp_path / "x")]) == 2
        assert f"error: --hf {bad}: {message}" in capsys.readouterr().err
    # a tensor missing, or one left over (also where each pipeline stage reads only its own layers)
    import torch
    from safetensors.torch import load_file as load_tensors
    from safetensors.torch import save_file

    tensors = load_tensors(str(hf1 / "model.safetensors"))
    for name, change in (("missing", lambda t: t.pop("backbone.blocks.0.attn_qkv.weight")),
                         ("extra", lambda t: t.update({"backbone.foo": torch.zeros(2)}))):
        shutil.copytree(hf1, tmp_path / name)
        edited = dict(tensors)
        change(edited)
        save_file(edited, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
    assert convert_from_hf.main(["--hf", str(tmp_path / "missing"), "--save", str(tmp_path / "x")]) == 2
    assert "error: tensor backbone.blocks.0.attn_qkv.weight (megatron layers.0.self_attention.linear_qkv.weight) " \
           "is missing from the HF weights" in capsys.readouterr().err
    extra = run_python([os.path.join(REPO, "tools", "convert_from_hf.py"), "--hf", str(tmp_path / "extra"), "--save",
                        str(tmp_path / "x"), "--pipeline-model-parallel-size", "2"], REPO, {**ENV, **launch_env(2)},
                       300, 2)
    assert extra.returncode != 0 and "unused weights ['backbone.foo']" in extra.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"")
    assert convert_from_hf.main(["--hf", str(tmp_path / "broken"), "--save", str(tmp_path / "x")]) == 2
    assert "config.json: not valid JSON" in capsys.readouterr().err
    _run([os.path.join(REPO, "tools", "convert_to_hf.py"), "--load", str(ckpt), "--out", str(hf2)])
    a, b = load_file(str(hf1 / "model.safetensors")), load_file(str(hf2 / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bool((a[k] == b[k]).all()), k
    import json

    first, second = json.loads((hf1 / "config.json").read_text()), json.loads((hf2 / "config.json").read_text())
    # the first export has the tokenizer the training run recorded, so it knows its EOS (and names
    # it BOS: documents start after it); the converted checkpoint records none (convert_from_hf
    # takes the weights, and says so)
    assert (first.pop("eos_token_id"), first.pop("pad_token_id"), first.pop("bos_token_id")) == (2, None, 2)
    assert first == second

    # training starts from the converted (model-only) checkpoint exactly as from the original
    # weights: the first loss equals a --finetune run's from the original checkpoint
    losses = []
    for load in (["--load", checkpoints["mdlm"], "--finetune"], ["--load", str(ckpt)]):
        proc, records = run_pretrain(1, ["--demo-cache-dir", demo_cache, "--family", "mdlm", *RUN, "--train-iters", "1",
                                         *load, "--tensorboard-dir", str(tmp_path / "tb"),
                                         "--save", str(tmp_path / f"run{len(losses)}")], tmp_path)
        losses.append([r["loss"] for r in records if "loss" in r])
    assert "weights only (a model-only checkpoint)" in proc.stdout
    assert losses[0] == losses[1] and len(losses[0]) == 1


def test_use_ema_without_ema_fails_clearly(checkpoints, tmp_path):
    proc = run_python([os.path.join(REPO, "tools", "convert_to_hf.py"), "--load", checkpoints["ar"],
                       "--out", str(tmp_path / "x"), "--use-ema"], REPO, {**ENV, **launch_env(1)}, 300)
    assert proc.returncode != 0
    assert "no EMA weights" in proc.stderr


def test_an_export_replaces_only_an_earlier_export(checkpoints, tmp_path, capsys):
    """--overwrite replaces an earlier export whole, and nothing else: not the checkpoint being
    exported nor a directory holding it or inside it, not a file, not a directory of other files.
    A staging directory that a killed export left beside --out goes with the next export. The
    import refuses flags an export already records, and leaves no empty --save behind."""
    import shutil

    from megatron_dllm.cli import convert_from_hf, convert_to_hf

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["mdlm"], ckpt)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_text("x")
    for out, message in [(ckpt, f"--out {ckpt} overlaps the checkpoint it converts ({ckpt})"),
                         (tmp_path, f"--out {tmp_path} overlaps the checkpoint"),
                         (ckpt / "iter_0000002" / "hf", "overlaps the checkpoint"),
                         (tmp_path / "notes.txt", "is a file; --overwrite replaces only an earlier export"),
                         (tmp_path / "data", "is not a Hugging Face export (no config.json)")]:
        assert convert_to_hf.main(["--load", str(ckpt), "--out", str(out), "--overwrite"]) == 2
        assert message in capsys.readouterr().err
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(checkpoints["mdlm"]))
    assert sorted(os.listdir(ckpt / "iter_0000002")) == sorted(os.listdir(os.path.join(checkpoints["mdlm"],
                                                                                       "iter_0000002")))
    assert (tmp_path / "notes.txt").read_text() == "mine" and os.listdir(tmp_path / "data") == ["x.bin"]
    stale = tmp_path / "hf.incomplete-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    _run([os.path.join(REPO, "tools", "convert_to_hf.py"), "--load", str(ckpt), "--out", str(tmp_path / "hf")])
    assert not stale.exists() and (tmp_path / "hf" / "config.json").is_file()
    # through a symlink (a `latest` link), the export it names is replaced; the link stays
    (tmp_path / "latest").symlink_to(tmp_path / "hf")
    assert convert_to_hf.main(["--load", str(ckpt), "--out", str(tmp_path / "latest"), "--overwrite"]) == 0
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "hf" / "config.json").is_file()
    assert not [n for n in os.listdir(tmp_path) if ".incomplete-" in n or n.endswith(".replaced")]

    hf = str(tmp_path / "hf")
    for flags, message in [(["--family", "ar"], f"--family ar: --hf {hf} is an export of family mdlm"),
                           (["--seq-length", "64"], f"--seq-length: --hf {hf} is an export")]:
        assert convert_from_hf.main(["--hf", hf, "--save", str(tmp_path / "imported"), *flags]) == 2
        assert message in capsys.readouterr().err
    proc = run_python([os.path.join(REPO, "tools", "convert_from_hf.py"), "--hf", hf, "--save",
                       str(tmp_path / "imported"), "--tensor-model-parallel-size", "2"], REPO,
                      {**ENV, **launch_env(1)}, 300)  # 2-way TP in a single process: refused
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-2000:]
    assert not (tmp_path / "imported").exists()


# --------------------------------------------------------------------------- worker (one process)


def _compare(out_root, tok_model, specs):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    from megatron_dllm.cli import convert_to_hf
    from megatron_dllm.hf import export

    torch.manual_seed(0)
    for spec in specs:
        family, ckpt = spec.split("=", 1)
        out = os.path.join(out_root, family)
        assert convert_to_hf.main(["--load", ckpt, "--out", out, "--tokenizer-type", "SentencePieceTokenizer",
                                   "--tokenizer-model", tok_model]) == 0
        model, identity, _, _ = export.load_megatron_model(ckpt)
        V = identity.vocab_size
        b, s = 3, 16
        ids = torch.randint(0, V, (b, s))
        pos = torch.arange(s)[None].repeat(b, 1)
        sigma = torch.zeros(b)
        if family == "esolm":
            pos = torch.stack([torch.randperm(s) for _ in range(b)])
            ids[:, s // 2:] = identity.mask_id
        if family == "duo":
            sigma = torch.tensor([0.05, 0.7, 3.0])
        if family == "mdlm":
            ids[:, ::3] = identity.mask_id
        mask = attend = None
        if family == "bd3lm":  # the training input [x_t ; x_0] under the block mask
            from megatron_dllm.families import get_family

            bd3 = get_family("bd3lm", identity.mask_id, V, **identity.family_options)
            noised = torch.where(torch.rand(b, s) < 0.5, identity.mask_id, ids)
            inp = bd3.model_input(ids, noised, torch.full((b, s), 0.5))
            ids, pos, mask, attend = inp.input_ids, inp.position_ids, inp.attention_mask, inp.attend()
        with torch.no_grad():
            ref = model(ids, pos, sigma, mask).transpose(0, 1)[..., :V].float()
        auto = AutoModelForCausalLM if family == "ar" else AutoModelForMaskedLM
        hf = auto.from_pretrained(out, trust_remote_code=True).eval()
        assert hf.config.family == family and hf.config.mask_token_id == identity.mask_id
        with torch.no_grad():
            got = hf(input_ids=ids, position_ids=pos, sigma=sigma, attention_mask=attend).logits
        assert got.shape == ref.shape, (got.shape, ref.shape)
        assert ref.abs().max() > 0, "the trained output layer should not be zero"
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"{family}: relative error {err}"
        if family == "duo":  # timesteps -> sigma through the log-linear schedule
            t = torch.tensor([0.1, 0.5, 0.9])
            with torch.no_grad():
                a = hf(input_ids=ids, timesteps=t).logits
                c = hf(input_ids=ids, sigma=-torch.log(1 - (1 - 1e-3) * t)).logits
            torch.testing.assert_close(a, c)
        if family == "bd3lm":  # no mask given: a clean sequence under the block-causal layout
            assert hf.config.family_options == {"block_size": 4, "noise": "mask"}
            with torch.no_grad():
                plain = hf(input_ids=ids[:, s:], position_ids=pos[:, s:]).logits
            torch.testing.assert_close(plain, got[:, s:])
        if family == "ar":
            gen = hf.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
            assert gen.shape == (1, 9) and hf.generation_config.eos_token_id == 2  # stops at </s> untold
            with torch.no_grad():  # greedy = argmax of the megatron model's next-token logits (up to a tie
                # within rounding: the export runs its output layer at the last position only)
                nxt = model(gen[:, :4], torch.arange(4)[None], torch.zeros(1)).transpose(0, 1)[0, -1, :V]
            assert nxt[gen[0, 4]] >= nxt.max() - 1e-5 * nxt.abs().max(), (gen, nxt.topk(2))
            # another stop token only moves where it stops: the EOD (a real input token, here a
            # document start) is never taken for padding, as a pad id equal to it would be
            start = torch.cat([torch.full((1, 1), 2), ids[:1, :3]], 1)
            full = hf.generate(start, max_new_tokens=5, do_sample=False, eos_token_id=None,
                               attention_mask=torch.ones_like(start))
            assert torch.equal(hf.generate(start, max_new_tokens=5, do_sample=False, eos_token_id=None), full)
        tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        assert tok.mask_token == "[MASK]" and tok.mask_token_id == identity.mask_id
        # batches pad with EOS and truncate at the model's context; the model knows its EOS
        assert (tok.pad_token_id, tok.model_max_length) == (hf.config.eos_token_id, hf.config.max_position_embeddings)
        assert tok.eos_token_id == hf.config.eos_token_id == 2
        assert type(AutoModel.from_pretrained(out, trust_remote_code=True)).__name__ == type(hf).__name__
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=tok_model)
        text = "To be, or not to be: that is the question.\n  Whether 'tis nobler [MASK] in the mind"
        # "[MASK]" written in text is text, as training's SentencePiece encodes it; the token itself is the mask
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
        assert identity.mask_id not in sp.encode(text) and tok.convert_tokens_to_ids("[MASK]") == identity.mask_id
        with open(os.path.join(out, "tokenizer.model"), "rb") as shipped, open(tok_model, "rb") as original:
            assert shipped.read() == original.read()
        if family == "mdlm":  # sampling from the export decodes as from the checkpoint, byte pieces included
            from megatron_dllm.sampling.loading import load_inference_model

            pieces = [sp.piece_to_id("<0xF8>"), sp.piece_to_id("<0x0A>"), *sp.encode("Day")]
            assert load_inference_model(out).tokenizer.detokenize(pieces) == sp.decode(pieces) == "\ufffd\n Day"
        print(f"OK {family} rel_err={err:.2e}", flush=True)

    # an existing export is refused, then replaced whole with --overwrite (no stale AR generation
    # config inside an MDLM export); every file is world-readable
    ar_dir, mdlm_ckpt = os.path.join(out_root, "ar"), dict(s.split("=", 1) for s in specs)["mdlm"]
    before = sorted(os.listdir(ar_dir))
    assert "generation_config.json" in before
    assert convert_to_hf.main(["--load", mdlm_ckpt, "--out", ar_dir]) == 2
    assert sorted(os.listdir(ar_dir)) == before
    assert convert_to_hf.main(["--load", mdlm_ckpt, "--out", ar_dir, "--overwrite"]) == 0
    assert ("generation_config.json" not in os.listdir(ar_dir)
            and '"mdlm"' in open(os.path.join(ar_dir, "config.json")).read())
    assert {oct(os.stat(os.path.join(ar_dir, n)).st_mode & 0o777) for n in os.listdir(ar_dir)} == {"0o644"}
    assert not [n for n in os.listdir(out_root) if ".incomplete" in n or ".replaced" in n]
    print("OK overwrite", flush=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "compare":
    _compare(sys.argv[2], sys.argv[3], sys.argv[4:])


def test_exported_sentencepiece_tokenizer_reads_special_strings_as_text(demo_cache, paragraphs, tmp_path, capsys):
    """Training encodes `</s>` or `[MASK]` written in a document as ordinary text (SentencePiece);
    so does the export. A model whose normalizer transformers' conversion drops (nmt_nfkc, collapsed
    whitespace) is exported with a note that some text encodes to other ids."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from megatron_dllm.data.prep.demo import prepare_demo_corpus
    from megatron_dllm.data.tokenizers import build_tokenizer
    from megatron_dllm.hf.export import export_tokenizer

    model = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    ours = build_tokenizer("SentencePieceTokenizer", model)
    export_tokenizer(str(tmp_path / "demo"), "SentencePieceTokenizer", model, ours.vocab_size, ours.mask_id)
    assert "note:" not in capsys.readouterr().err  # the demo's identity normalizer converts exactly
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "demo"), local_files_only=True)
    for text in ("a</s>b <s> [MASK] <unk>", "KING.\n\n  Thou art\tgone!", paragraphs[3]):
        assert hf.encode(text, add_special_tokens=False) == ours.tokenize(text), text
    assert hf.mask_token_id == ours.mask_id == 4096

    spm.SentencePieceTrainer.train(sentence_iterator=iter(paragraphs), model_prefix=str(tmp_path / "nfkc"),
                                   vocab_size=300, model_type="bpe", num_threads=1, minloglevel=2)  # nmt_nfkc
    nfkc = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "nfkc.model"))
    export_tokenizer(str(tmp_path / "nfkc"), "SentencePieceTokenizer", str(tmp_path / "nfkc.model"),
                     nfkc.vocab_size, nfkc.mask_id)
    assert "note: the exported tokenizer encodes some text to other ids" in capsys.readouterr().err


def test_an_exported_unigram_sentencepiece_tokenizer_segments_as_training(paragraphs, tmp_path, capsys):
    """SentencePiece's default model type is unigram, which the Llama conversion would turn into a
    BPE of other segmentations (most lines to other ids); the export keeps it a unigram."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from megatron_dllm.data.tokenizers import build_tokenizer
    from megatron_dllm.hf.export import export_tokenizer

    spm.SentencePieceTrainer.train(sentence_iterator=iter(paragraphs), model_prefix=str(tmp_path / "uni"),
                                   vocab_size=500, num_threads=1, minloglevel=2)  # unigram, nmt_nfkc
    ours = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "uni.model"))
    export_tokenizer(str(tmp_path / "hf"), "SentencePieceTokenizer", str(tmp_path / "uni.model"), ours.vocab_size,
                     ours.mask_id)
    assert "note:" not in capsys.readouterr().err
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    lines = [line for p in paragraphs[:40] for line in p.splitlines() if line.strip()]
    assert len(lines) > 100 and all(hf.encode(t, add_special_tokens=False) == ours.tokenize(t) for t in lines)
    assert (hf.mask_token_id, hf.eos_token_id) == (ours.mask_id, ours.eod)
    assert hf.decode(ours.tokenize(lines[0])) == lines[0]


def test_an_exported_tokenizer_json_adds_no_bos_training_never_saw(tmp_path):
    """A tokenizer.json whose post-processor prepends a BOS (Llama's, TinyLlama's): training encodes
    without it, and so does the export, `tok(text)` included."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from megatron_dllm.data.tokenizers import build_tokenizer
    from megatron_dllm.hf.export import export_tokenizer

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i + 3 for i in range(60)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    (tmp_path / "tok").mkdir()
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    ours = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok" / "tokenizer.json"))
    export_tokenizer(str(tmp_path / "hf"), "HuggingFaceTokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                     ours.vocab_size, ours.mask_id)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert ours.tokenize("w5 w7 w9") == [8, 10, 12] == hf("w5 w7 w9")["input_ids"] == hf.encode("w5 w7 w9")
