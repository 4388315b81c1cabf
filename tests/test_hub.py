"""Pushing grown models to the Hub (offline, with a fake HfApi) and their model cards."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import CommitOperationDelete, ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

import hf_grow
from hf_grow import cli, grow_model, hub, load_growth_report, push_to_hub
from quickstart import train_small_gpt2
from conftest import tiny_gpt2_config
from test_cli import SMALL, TEXT_GLOB, TRAIN_FILES, run_cli


class FakeApi:
    """Records what would reach the Hub; the committed files are read at commit time, as HfApi does. ``files``:
    the repository's files after the commits (those of ``repo_files`` before)."""

    def __init__(self, repo_files: dict[str, bytes] | None = None):
        self.calls = []
        self.files: dict[str, bytes] = dict(repo_files or {})

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def list_repo_files(self, repo_id, revision=None):
        return list(self.files)

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, kwargs))
        for operation in operations:
            if isinstance(operation, CommitOperationDelete):
                del self.files[operation.path_in_repo]  # HfApi fails on a file the repository lacks
            else:
                self.files[operation.path_in_repo] = Path(operation.path_or_fileobj).read_bytes()
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")


GROWN_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "configuration_grown_gpt2.py",
    "modeling_grown_gpt2.py",
    "paged_grown_gpt2.py",  # continuous batching, imported by the modeling file
    "growth_report.json",
    "README.md",
}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    train_small_gpt2(folder, TRAIN_FILES, steps=30, vocab_size=400)
    return folder


@pytest.fixture(scope="module")
def grown(model_folder):
    model = GPT2LMHeadModel.from_pretrained(model_folder)
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    ids = torch.tensor(tokenizer(open(TRAIN_FILES[0]).read())["input_ids"][: 8 * 32 * 5]).reshape(5, 8, 32)
    batches = [{"input_ids": batch, "labels": batch} for batch in ids]
    return grow_model(model, batches[:4], budget=16, multiple_of=8, eval_dataloader=batches[4:]), tokenizer


def test_push_a_model_commits_everything_once(grown, model_folder, tmp_path):
    model, tokenizer = grown
    api = FakeApi()
    commit = push_to_hub(
        model, "me/grown-gpt2", private=True, api=api, tokenizer=tokenizer, base_model="openai-community/gpt2"
    )
    assert commit.commit_url.startswith("https://huggingface.co/me/grown-gpt2")
    assert [call[0] for call in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0] == ("create_repo", "me/grown-gpt2", {"private": True, "exist_ok": True})
    assert api.calls[1][2]["commit_message"] == "Upload a model grown by hf_grow"
    assert api.calls[1][2]["revision"] is None
    assert set(api.files) == GROWN_FILES | TOKENIZER_FILES
    config = json.loads(api.files["config.json"])
    assert config["hf_grow_version"] == model.growth_report.hf_grow_version == hf_grow.__version__
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_grown_gpt2.GrownGPT2LMHeadModel"
    card = ModelCard(api.files["README.md"].decode())
    assert card.data.base_model == "openai-community/gpt2" and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and "hf_grow" in card.data.tags
    report = model.growth_report
    for fact in (f"{report.parameters_added:,} added", f"λ = {report.lam:.4g}", f"{report.eval_loss_after:.4f}",
                 "trust_remote_code=True", 'from_pretrained("me/grown-gpt2")', "allocated to the layers",
                 f"`step_mode` {report.step_mode}", "- Gradient M: the mean over all statistics batches.",
                 "- Mode: `refactor`, every query/key weight rewritten", "(perplexity ",
                 f"- Grown with hf_grow {hf_grow.__version__}.", "its own modeling code (it needs transformers 5.24"):
        assert fact in card.text, fact
    for layer in report.layers:
        assert f"| {layer.layer} | {layer.qk_dim_before} | {layer.qk_dim_after} |" in card.text
    # What was committed is a complete checkpoint.
    for name, content in api.files.items():
        (tmp_path / name).write_bytes(content)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.qk_head_dims == model.config.qk_head_dims
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert load_growth_report(tmp_path).to_dict() == report.to_dict()


def test_push_a_folder_to_a_branch(grown, tmp_path, caplog):
    model, tokenizer = grown
    model.save_pretrained(tmp_path / "saved")
    api = FakeApi()
    # tokenizer= with a folder was dropped without a word (the folder is pushed as it is)
    with pytest.raises(ValueError, match=r"save the tokenizer into it \(tokenizer.save_pretrained\(folder\)\)"):
        push_to_hub(tmp_path / "saved", "me/grown", api=api, tokenizer=tokenizer)
    assert api.calls == []
    with caplog.at_level(logging.WARNING, logger="hf_grow"):
        push_to_hub(tmp_path / "saved", "me/grown", revision="experiment", commit_message="grown", api=api)
    assert "without a tokenizer: save the tokenizer into it" in caplog.text
    assert api.calls[1] == ("create_branch", "me/grown", {"branch": "experiment", "exist_ok": True})
    assert api.calls[2][2] == {"commit_message": "grown", "revision": "experiment"}
    assert set(api.files) == GROWN_FILES  # a card was made for the folder, which is left as it was
    assert not (tmp_path / "saved" / "README.md").exists()
    assert ModelCard(api.files["README.md"].decode()).data.base_model is None  # unknown: no metadata


def test_a_push_deletes_the_weights_of_an_earlier_push_that_it_does_not_replace(grown, tmp_path):
    """The Hub keeps what a commit does not delete: a model pushed as one file, then pushed sharded, left the single
    file beside the shards, and from_pretrained reads model.safetensors before a shard index (the old weights)."""
    model, _ = grown
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    kept = {"model.safetensors": b"old", "pytorch_model.bin": b"old", "notes/model.safetensors": b"mine",
            "adapter_model.safetensors": b"mine", ".gitattributes": b"*"}
    api = FakeApi(kept)
    push_to_hub(tmp_path / "sharded", "me/grown", api=api)
    shards = {path.name for path in (tmp_path / "sharded").glob("model-*.safetensors")}
    assert len(shards) > 1 and "model.safetensors.index.json" in api.files and shards <= set(api.files)
    assert {"model.safetensors", "pytorch_model.bin"}.isdisjoint(api.files)  # an unrelated file stays
    assert {"notes/model.safetensors", ".gitattributes"} <= set(api.files)
    assert "adapter_model.safetensors" not in api.files  # from_pretrained would apply it to the grown model
    model.save_pretrained(tmp_path / "single")  # and back: the shards and their index go
    push_to_hub(tmp_path / "single", "me/grown", api=api)
    assert {name for name in api.files if name.startswith(("model.", "model-"))} == {"model.safetensors"}


def test_save_pretrained_with_push_to_hub_uploads_a_complete_folder(grown, tmp_path, monkeypatch):
    """transformers uploads inside `save_pretrained(push_to_hub=True)`, which used to run before the source
    files and the report were written: the Hub got an auto_map pointing at files it did not have."""
    import transformers.utils.hub as transformers_hub

    uploads = []

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        written = {path.name for path in Path(working_dir).iterdir()
                   if path.name not in files_timestamps or path.stat().st_mtime > files_timestamps[path.name]}
        uploads.append((Path(working_dir), repo_id, kwargs, written))

    repos, deleted = [], []
    api = SimpleNamespace(
        create_repo=lambda repo_id, **options: repos.append(options) or SimpleNamespace(repo_id=repo_id),
        file_exists=lambda repo_id, filename, **options: True,
        delete_file=lambda path, repo_id, **options: deleted.append((path, repo_id, options["revision"])),
    )
    monkeypatch.setattr(transformers_hub, "hf_api", lambda: api)
    tagged = []
    monkeypatch.setattr(transformers_hub, "create_and_tag_model_card",
                        lambda repo_id, tags, **__: tagged.append(tags) or ModelCard("---\n---\ncard"))
    monkeypatch.setattr(transformers_hub.PushToHubMixin, "_upload_modified_files", upload)
    model, _ = grown
    out = tmp_path / "out"
    model.save_pretrained(out, push_to_hub=True, repo_id="me/grown", commit_message="grown", private=True)
    # the folder itself is uploaded, the card transformers makes written there, as transformers' own save does
    assert uploads == [(out, "me/grown", {"commit_message": "grown", "token": None}, GROWN_FILES)]
    assert {path.name for path in out.iterdir()} == GROWN_FILES and repos[0]["private"] is True
    assert tagged == [["grown-attention", "hf_grow"]]  # the model's tags, as transformers' own push (they were lost)
    # saved again with the save options (shards): the files this save wrote; a card already there is kept
    (out / "README.md").write_text("---\n---\nthe grown model's own card")
    model.save_pretrained(out, push_to_hub=True, repo_id="me/grown", max_shard_size="100KB")
    shards = {path.name for path in out.glob("model-*.safetensors")}
    assert len(shards) > 1  # (the first save's model.safetensors stays in the folder, not uploaded again)
    assert uploads[1][3] == GROWN_FILES - {"model.safetensors"} | shards | {"model.safetensors.index.json"}
    assert (out / "README.md").read_text().endswith("the grown model's own card")
    assert not deleted
    # after a growth that leaves no report (a baseline's), the report pushed before is removed there too (it stayed)
    report, model.growth_report = model.growth_report, None
    try:
        model.save_pretrained(out, push_to_hub=True, repo_id="me/grown", revision="v2")
    finally:
        model.growth_report = report  # the module's fixture
    assert deleted == [("growth_report.json", "me/grown", "v2")] and not (out / "growth_report.json").exists()
    model.save_pretrained(tmp_path / "tagged", push_to_hub=True, repo_id="me/grown", tags="mine")  # not its letters
    assert tagged[-1] == ["grown-attention", "hf_grow", "mine"]


def test_the_card_of_a_step_zero_growth_says_so(model_folder, tmp_path):
    model = GPT2LMHeadModel.from_pretrained(model_folder)
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    ids = torch.tensor(tokenizer(open(TRAIN_FILES[0]).read())["input_ids"][: 2 * 8 * 32]).reshape(2, 8, 32)
    grown = grow_model(model, [{"input_ids": ids[0], "labels": ids[0]}], p=8, step_size=0.0,
                       eval_dataloader=[{"input_ids": ids[1], "labels": ids[1]}], measure_realized_gains=False)
    grown.save_pretrained(tmp_path / "zero")
    card = hf_grow.model_card(tmp_path / "zero", base_model=None)
    assert "the old function, up to floating-point\nrounding: this model took step 0" in card.text
    assert "- Step: size 0 " in card.text


def test_bad_pushes_are_refused_before_anything(grown, tmp_path, monkeypatch):
    model, _ = grown
    api = FakeApi()
    with pytest.raises(ValueError, match="invalid Hub repository id"):
        push_to_hub(model, "not a repo id", api=api)
    (tmp_path / "plain").mkdir()
    plain = GPT2LMHeadModel(tiny_gpt2_config())
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no auto_map"):
        push_to_hub(tmp_path / "plain", "me/plain", api=api)
    with pytest.raises(ValueError, match=r"no growth_report: .*= hf_grow.load_growth_report\(folder\)"):
        push_to_hub(plain, "me/plain", api=api)
    loaded = AutoModelForCausalLM.from_pretrained(_saved(model, tmp_path / "grown"))  # no report: fine-tuned, say
    loaded.save_pretrained(tmp_path / "fine-tuned")
    with pytest.raises(ValueError, match="lacks growth_report.json: a grown model loaded with from_pretrained and "
                                         "saved again writes none; copy the growth_report.json"):
        push_to_hub(tmp_path / "fine-tuned", "me/fine-tuned", api=api)
    monkeypatch.setattr(hub, "is_offline_mode", lambda: True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        push_to_hub(model, "me/grown", api=api)
    assert api.calls == []


def _saved(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def test_only_the_main_process_pushes(grown, monkeypatch):
    monkeypatch.setattr(hub, "_is_main_process", lambda: False)
    api = FakeApi()
    assert push_to_hub(grown[0], "me/grown", api=api) is None and api.calls == []


def test_cli_pushes_the_output_folder(model_folder, tmp_path, monkeypatch):
    api = FakeApi()
    monkeypatch.setattr(hub, "HfApi", lambda: api)
    monkeypatch.setattr(hub, "is_offline_mode", lambda: False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    output = tmp_path / "grown"
    code = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--p", "8",
                     "--push-to-hub", "me/cli-grown", "--private", "--revision", "v1", "--commit-message", "first",
                     *SMALL])
    assert code == 0
    assert api.calls[0] == ("create_repo", "me/cli-grown", {"private": True, "exist_ok": True})
    assert api.calls[2][2] == {"commit_message": "first", "revision": "v1"}
    assert set(api.files) == {path.name for path in output.iterdir()}
    assert GROWN_FILES | TOKENIZER_FILES <= set(api.files)
    local, pushed = ModelCard.load(output / "README.md"), ModelCard(api.files["README.md"].decode())
    assert pushed.data.pipeline_tag == "text-generation"
    # The local card records the local base model; the Hub refuses local paths as metadata, so the pushed one has
    # none, and its text names the folder, not this machine's path; it is titled by the repository
    assert local.data.base_model == str(model_folder.resolve()) and pushed.data.base_model is None
    assert f"`{model_folder.resolve()}` with" in local.text and str(model_folder) not in pushed.text
    assert f"`{model_folder.name}` with" in pushed.text and "local text" in pushed.text
    assert pushed.text.replace(f"`{model_folder.name}` with", f"`{model_folder.resolve()}` with") == local.text
    assert 'from_pretrained("me/cli-grown"' in pushed.text
    assert 'tokenizer = AutoTokenizer.from_pretrained("me/cli-grown", trust_remote_code=True)' in pushed.text


def test_a_cli_folder_pushed_later_from_elsewhere(model_folder, tmp_path, monkeypatch):
    """The CLI names a model given by a relative path by its absolute path, so a push from another folder still
    leaves it out of the metadata; the card's loading snippets then name the repository, not the folder."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "small").symlink_to(model_folder)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["models/small", "--data", TEXT_GLOB, "--output-dir", "grown", "--step-size", "0.0", *SMALL]) == 0
    monkeypatch.chdir(tmp_path / "models")  # here, "models/small" would not exist: only the card can tell
    api = FakeApi()
    push_to_hub(tmp_path / "grown", "me/later", api=api)
    card = ModelCard(api.files["README.md"].decode())
    assert card.data.base_model is None and 'from_pretrained("grown"' not in card.text
    assert card.text.lstrip().startswith("# later\n")  # titled by the repository, not the folder
    assert 'AutoModelForCausalLM.from_pretrained("me/later", trust_remote_code=True)' in card.text


def test_cli_push_fails_offline_in_one_line_before_any_work(model_folder, tmp_path, monkeypatch, capsys):
    never_read = [str(model_folder), "--data", "/nonexistent/never-read.txt", "--output-dir", str(tmp_path / "out")]
    result = run_cli(*never_read, "--push-to-hub", "me/grown")  # run_cli sets HF_HUB_OFFLINE=1
    assert result.returncode == 2 and "HF_HUB_OFFLINE" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    monkeypatch.setattr(hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(hub, "get_token", lambda: None)
    for repo_id, message in (("me/grown", "not logged in"), ("me/bad name", "invalid Hub repository id")):
        assert cli.main([*never_read, "--push-to-hub", repo_id]) == 2
        error = capsys.readouterr().err
        assert message in error and len(error.strip().splitlines()) == 1


def test_cli_keeps_the_attention_scale_and_the_card_says_so(model_folder, tmp_path):
    outputs = {}
    for name, flags in {"kept": ["--keep-attention-scale"], "folded": []}.items():
        outputs[name] = tmp_path / name
        assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(outputs[name]), "--step-size",
                         "0.0", *flags, *SMALL]) == 0
    kept = AutoModelForCausalLM.from_pretrained(outputs["kept"])
    assert kept.config.attention_scale_dims == [16, 16] and kept.config.qk_head_dims == [24, 24]
    assert "Attention scale: kept at the old widths'" in (outputs["kept"] / "README.md").read_text()
    assert json.loads((outputs["kept"] / "growth_report.json").read_text())["config"]["keep_attention_scale"]
    assert AutoModelForCausalLM.from_pretrained(outputs["folded"]).config.attention_scale_dims is None
    assert "Attention scale: follows the new query/key width" in (outputs["folded"] / "README.md").read_text()


def test_a_trainer_output_folder_pushes_the_model_alone(grown, tmp_path, caplog):
    """A grown model fine-tuned with Trainer(output_dir=folder) and saved there holds the run's checkpoints, state
    and pickled arguments beside it: all were committed (7x the model's size for two checkpoints)."""
    model, _ = grown
    folder = tmp_path / "run"
    model.save_pretrained(folder)
    for name in ("checkpoint-2/optimizer.pt", "checkpoint-2/model.safetensors", "runs/events.out", "training_args.bin",
                 "trainer_state.json", "all_results.json", "adapter_config.json", "adapter_model.safetensors",
                 "additional_chat_templates/tool_use.jinja"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"training")
    api = FakeApi({"adapter_config.json": b"{}", "adapter_model.safetensors": b"old adapter"})
    with caplog.at_level(logging.WARNING, logger="hf_grow"):
        push_to_hub(folder, "me/grown", api=api)
    # the stale adapter deleted, nothing of the run or of an adapter saved there added (from_pretrained would apply
    # it), a tokenizer's further chat templates kept
    assert set(api.files) == GROWN_FILES | {"additional_chat_templates/tool_use.jinja"}
    left_out = "adapter_config.json, adapter_model.safetensors, all_results.json, checkpoint-2, runs, trainer_state"
    assert "not pushed from" in caplog.text and left_out in caplog.text


def test_the_command_keeps_a_local_models_license_and_its_terms_files(grown, tmp_path):
    """A grown Llama pushed from the command lost its license: the card's `license`, `language` were replaced and
    the LICENSE and USE_POLICY files (which Llama's license requires with every copy) not copied."""
    from argparse import Namespace

    from hf_grow.cli.checks import not_a_saved_model
    from hf_grow.cli.running import write_card

    model, tokenizer = grown
    source, folder = tmp_path / "source", tmp_path / "grown"
    source.mkdir()
    (source / "README.md").write_text("---\nlicense: llama3.2\nlanguage:\n- en\n- de\ntags:\n- text\n---\n\n# Model\n")
    (source / "LICENSE.txt").write_text("the terms")
    (source / "USE_POLICY.md").write_text("the policy")
    model.save_pretrained(folder)
    args = Namespace(model=str(source), push_to_hub=None, output_dir=str(folder))
    write_card(args, folder, data="text", datasets=[])
    card = ModelCard.load(folder / "README.md")
    assert card.data.license == "llama3.2" and card.data.language == ["en", "de"] and "hf_grow" in card.data.tags
    assert (folder / "LICENSE.txt").read_text() == "the terms"
    assert (folder / "USE_POLICY.md").read_text() == "the policy"
    assert not_a_saved_model(folder) is None  # --overwrite replaces the folder again
    # a card saved with a byte-order mark (Windows editors): its terms were lost when it was read as plain UTF-8
    (source / "README.md").write_text("\ufeff---\nlicense: mit\n---\n", encoding="utf-8")
    write_card(args, folder, data="text", datasets=[])
    assert ModelCard.load(folder / "README.md").data.license == "mit"
    assert hf_grow.card.card_terms("\ufeff---\nlicense: mit\n---\n") == {"license": "mit"}  # a loaded ST's card
    for damaged in ("---\n- not a mapping\n---\n", "---\nlicense: [unclosed\n---\n"):  # the YAML's own error too
        (source / "README.md").write_text(damaged)  # a damaged card keeps nothing, and fails nothing
        write_card(args, folder, data="text", datasets=[])
        assert ModelCard.load(folder / "README.md").data.license is None


def test_the_command_keeps_a_hub_models_license_fetched_with_its_card(grown, tmp_path, monkeypatch, capsys):
    """from_pretrained fetches neither a Hub model's card nor its terms files: the command fetches those alone (into
    the Hub cache); where it cannot (offline), it says the card names no license, and the write goes on."""
    import huggingface_hub

    from hf_grow.cli.running import write_card

    model, _ = grown
    snapshot, folder = tmp_path / "snapshot", tmp_path / "grown"
    snapshot.mkdir()
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# Model\n")
    (snapshot / "NOTICE").write_text("the notice")
    fetched = []

    def snapshot_download(repo_id, allow_patterns):
        fetched.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model.save_pretrained(folder)
    args = SimpleNamespace(model="someone/model", push_to_hub=None, output_dir=str(folder))
    write_card(args, folder, data="text", datasets=[])
    assert fetched == [("someone/model", ["README.md", "LICENSE*", "NOTICE*", "USE_POLICY*", "license*", "notice*"])]
    assert ModelCard.load(folder / "README.md").data.license == "apache-2.0"
    assert (folder / "NOTICE").read_text() == "the notice"

    def offline(repo_id, allow_patterns):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    (folder / "NOTICE").unlink()
    write_card(args, folder, data="text", datasets=[])
    assert ModelCard.load(folder / "README.md").data.license is None and not (folder / "NOTICE").exists()
    assert "the card of someone/model could not be fetched (LocalEntryNotFoundError)" in capsys.readouterr().err
    # offline, the snapshot from_pretrained cached (config and weights, no card) comes back without an error
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns: str(tmp_path / "cached"))
    (tmp_path / "cached").mkdir()
    (tmp_path / "cached" / "LICENSE.txt").write_text("the terms")  # a repository's terms without a card: copied
    write_card(args, folder, data="text", datasets=[])
    assert ModelCard.load(folder / "README.md").data.license is None
    assert (folder / "LICENSE.txt").read_text() == "the terms"
    assert "the card of someone/model is not in the Hub cache (offline) or the repository has none: the grown " \
        "model's card names no license" in capsys.readouterr().err
