"""Checkpoint folders: bit-exact round trips and clear refusals of bad files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_checkpoint, read_config, save_checkpoint, upgrade_config
from model.config import ARCHITECTURE_CONFIGS, FORMAT_VERSION, CheckpointConfig, ConfigError, LRNNConfig, migrate_config
from tests.model.tiny_models import ARCHITECTURE_OF, MODEL_IDS, build_tiny, tiny_configs


def transducer_config(model_id: str) -> CheckpointConfig:
    model_config = tiny_configs(vocab_size=2, num_labels=2)[model_id]
    return CheckpointConfig(
        architecture=ARCHITECTURE_OF[type(model_config)],
        model=model_config,
        kind="transduce",
        task="parity_check",
        alphabet="01",
        labels=("0", "1"),
        metadata={"steps": 3},
    )


def saved(tmp_path: Path, model_id: str = "lrnn", dtype: torch.dtype = torch.float32) -> tuple[Path, torch.nn.Module]:
    model = build_tiny(model_id, 2, 2).to(dtype).eval()
    directory = save_checkpoint(model, transducer_config(model_id), tmp_path / "ckpt")
    return directory, model


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_round_trip_is_bit_exact(tmp_path: Path, model_id: str) -> None:
    directory, model = saved(tmp_path, model_id)
    loaded = load_checkpoint(directory, device="cpu")
    assert loaded.config == transducer_config(model_id)
    original, restored = model.state_dict(), loaded.model.state_dict()
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    tokens = torch.randint(0, 2, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded.model(tokens))


def test_bfloat16_checkpoint_loads_in_bfloat16(tmp_path: Path) -> None:
    directory, model = saved(tmp_path, dtype=torch.bfloat16)
    loaded = load_checkpoint(directory, device="cpu")
    assert loaded.model.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name]), name


def test_language_model_config_round_trips_through_json(tmp_path: Path) -> None:
    config = CheckpointConfig(
        architecture="lrnn",
        model=LRNNConfig(vocab_size=300, d_model=16, block_size=4, num_blocks=2, d_ff=32),
        kind="generate",
        tokenizer="tiny-bpe",
    )
    assert CheckpointConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_save_writes_nothing_but_the_two_files(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]


def test_saved_files_are_world_readable(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    for name in ("config.json", "model.safetensors"):
        assert (directory / name).stat().st_mode & 0o777 == 0o644, name


def test_a_version_1_file_loads_as_the_build_that_wrote_it_meant(tmp_path: Path) -> None:
    """Version 1 files could leave out keys with defaults; migration fills them with version 1's values."""
    directory, model = saved(tmp_path)

    def to_version_1(data: dict) -> None:
        data["format_version"] = 1
        for key in ("tokenizer", "metadata"):
            data.pop(key)
        for key in ("transition_norm", "p_norm", "scan_impl", "dropout", "layer_norm_eps"):
            data["model"].pop(key)

    edit_config(directory, to_version_1)
    loaded = load_checkpoint(directory, device="cpu")
    assert loaded.config == dataclasses.replace(transducer_config("lrnn"), metadata={})
    assert loaded.config.model.transition_norm == "column" and loaded.config.model.p_norm == 1.2
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name]), name


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURE_CONFIGS))
def test_version_1_defaults_cover_every_key(architecture: str) -> None:
    """A version 1 file with only the keys that never had defaults migrates to a complete version 2 config: a
    key added later must get its version 1 meaning in model/config.py's _V1_DEFAULTS."""
    required = {"construction": "parity"} if architecture == "exact" else {}
    data = {
        "format_version": 1,
        "architecture": architecture,
        "kind": "transduce",
        "alphabet": "01",
        "labels": ["0", "1"],
        "model": {"vocab_size": 2, "num_labels": 2, **required},
    }
    config = CheckpointConfig.from_dict(migrate_config(data))
    assert config.format_version == FORMAT_VERSION
    assert CheckpointConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_version_4_regulargpt_hands_on_its_layers_own_outputs(tmp_path: Path) -> None:
    """Level codes came in version 5: an older RegularGPT file has none; a language model cannot have them."""
    data = json.loads(json.dumps(transducer_config("regulargpt-c2").to_dict()))
    data["format_version"] = 4
    data["model"].pop("level_codes")
    assert CheckpointConfig.from_dict(migrate_config(data)).model.level_codes is False
    data = {**data, "kind": "generate", "alphabet": None, "labels": None, "tokenizer": "tiny-bpe"}
    data["model"] = {**data["model"], "num_labels": 0, "level_codes": True}
    with pytest.raises(ConfigError, match="level_codes needs a transducer's labels"):
        CheckpointConfig.from_dict(migrate_config(data))


def edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(extra=1), "unknown key(s) ['extra']"),
        (lambda d: d["model"].update(n_heads=4), "model: unknown key(s) ['n_heads']"),
        (lambda d: d["model"].pop("vocab_size"), "missing key(s) ['vocab_size']"),
        (lambda d: d["model"].update(block_size="4"), "model.block_size: expected an integer"),
        (lambda d: d["model"].update(scan_impl="magic"), "'magic' is not one of"),
        (lambda d: d.update(architecture="mamba"), "unknown architecture 'mamba'"),
        (lambda d: d.update(alphabet="012"), "the alphabet has 3 symbols"),
        (lambda d: d.update(labels=["0", "0"]), "repeat a label"),
        (lambda d: d.update(kind="classify"), "config.kind: 'classify' is not one of"),
        (lambda d: d["model"].update(p_norm=0.5), "p_norm must be >= 1"),
        (lambda d: d.update(format_version=FORMAT_VERSION + 1), f"unsupported format_version {FORMAT_VERSION + 1}"),
        (lambda d: d.pop("format_version"), "missing key 'format_version'"),
        # version 2 holds every key: one with a default is not filled in silently
        (lambda d: d["model"].pop("transition_norm"), "model: missing key(s) ['transition_norm']"),
        (lambda d: d.pop("tokenizer"), "config: missing key(s) ['tokenizer']"),
    ],
)
def test_bad_config_is_refused_with_a_message_that_names_it(tmp_path: Path, edit, message: str) -> None:
    directory, _ = saved(tmp_path)
    edit_config(directory, edit)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory, device="cpu")
    assert message in str(error.value)
    assert "config.json" in str(error.value)


def test_invalid_json_and_missing_files(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        load_checkpoint(directory, device="cpu")
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(directory)
    with pytest.raises(CheckpointError, match="config.json: missing"):
        read_config(tmp_path / "nowhere")


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_weights_are_refused(tmp_path: Path, keep: int) -> None:
    directory, _ = saved(tmp_path)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(directory, device="cpu")


def test_corrupted_tensor_bytes_are_caught_by_the_digest(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # flip one bit inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        load_checkpoint(directory, device="cpu")


def test_corrupted_header_is_refused(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[10:14] = b"\xff\xfe\x00{"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(directory, device="cpu")


def rewrite_tensors(directory: Path, edit) -> None:
    """Rewrite the weights file without digests (as another tool would), after editing the tensors."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        embedding = next(n for n in tensors if n.endswith("embed.weight"))
        tensors.pop(embedding)
        tensors["stray.weight"] = torch.zeros(3)
        name = next(n for n in tensors if n.endswith("weight") and tensors[n].dim() == 2)
        tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])

    rewrite_tensors(directory, edit)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory, device="cpu")
    message = str(error.value)
    assert "missing tensors [" in message and "embed.weight" in message
    assert "unexpected tensors ['stray.weight']" in message
    assert "in the file" in message and "in the model" in message


def test_non_finite_weights_are_refused(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    rewrite_tensors(
        directory, lambda t: next(v for n, v in t.items() if n.endswith("embed.weight")).fill_(float("nan"))
    )
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        load_checkpoint(directory, device="cpu")


def test_saving_with_a_config_that_does_not_describe_the_model_fails(tmp_path: Path) -> None:
    model = build_tiny("lrnn", 2, 2)
    with pytest.raises(CheckpointError, match="differ from config.model"):
        save_checkpoint(model, transducer_config("lstm"), tmp_path / "x")


def test_config_refuses_wrong_model_class() -> None:
    with pytest.raises(ConfigError, match="needs a RegularGPTConfig"):
        CheckpointConfig(
            architecture="regulargpt",
            model=tiny_configs(2, 2)["lrnn"],
            kind="transduce",
            alphabet="01",
            labels=("0", "1"),
        )


def test_upgrade_rewrites_an_old_config_once_and_keeps_its_meaning(tmp_path: Path) -> None:
    directory, _ = saved(tmp_path)
    edit_config(directory, lambda d: (d.update(format_version=1), d["model"].pop("transition_norm")))
    before = read_config(directory)
    assert upgrade_config(directory) is True
    data = json.loads((directory / "config.json").read_text())
    assert data["format_version"] == FORMAT_VERSION and data["model"]["transition_norm"] == "column"
    assert read_config(directory) == before
    assert upgrade_config(directory) is False


def test_shipped_checkpoints_are_in_the_current_format() -> None:
    for config_file in sorted(Path("checkpoints").glob("*/config.json")):
        data = json.loads(config_file.read_text())
        assert data["format_version"] == FORMAT_VERSION, config_file
        assert data == json.loads(json.dumps(read_config(config_file.parent).to_dict())), config_file
