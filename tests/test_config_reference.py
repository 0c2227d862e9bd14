"""docs/config.md is generated from the run-spec models and the CLI parsers (tools/config_reference.py); it
must match what the code says now, and name every field and every flag that sets one."""

from __future__ import annotations

from pathlib import Path

from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def _generator():
    return load_script("tools/config_reference.py")


def test_config_reference_is_up_to_date() -> None:
    generator = _generator()
    assert DOC.read_text(encoding="utf-8") == generator.render(), (
        f"docs/config.md is out of date with the run-spec models or the CLI flags: run `{generator.COMMAND}` "
        "and commit docs/config.md")


def test_config_reference_names_every_field_and_flag() -> None:
    from moetrain.cli.rl import FLAG_FIELDS as RL_FLAGS
    from moetrain.cli.train import FLAG_FIELDS as TRAIN_FLAGS
    from moetrain.config.run import RunSpec
    from moetrain.rl.spec import RLRunSpec

    text = DOC.read_text(encoding="utf-8")
    generator = _generator()

    def leaves(model, prefix=()):
        for name, field in model.model_fields.items():
            sub = generator.nested_model(field)
            yield from leaves(sub, (*prefix, name)) if sub else [".".join((*prefix, name))]

    # a trainer.* field moetrain rl takes as it is stands in the RunSpec table, under its own name
    missing = [f for model in (RunSpec, RLRunSpec) for f in leaves(model)
               if f"| `{f}` |" not in text and f"| `{f.removeprefix('trainer.')}` |" not in text]
    assert missing == []
    flags = [f"`--{dest.replace('_', '-')}`" for dest in (*TRAIN_FLAGS, *RL_FLAGS) if dest != "from_path"]
    assert [f for f in flags if f not in text] == []
