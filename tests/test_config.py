"""Typed YAML configs with key=value overrides; unknown keys and bad values are named."""

import dataclasses
import re
from pathlib import Path
from typing import Literal

import pytest

from areal_jax.config import ConfigError, from_dict, load_config, to_dict

QUICKSTART = Path(__file__).parent.parent / "configs" / "quickstart.yaml"


@dataclasses.dataclass
class Optim:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)


@dataclasses.dataclass
class Experiment:
    name: str
    steps: int = 10
    mode: Literal["async", "sync"] = "async"
    seed: int | None = None
    optim: Optim = dataclasses.field(default_factory=Optim)
    tags: list[str] = dataclasses.field(default_factory=list)
    extra: Optim | None = None


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: run\noptim:\n  lr: 3.0e-4\ntags: [a]\n")
    cfg = load_config(Experiment, f, ["steps=5", "optim.betas=[0.8, 0.9]", "mode=sync", "seed=7"])
    assert cfg == Experiment(name="run", steps=5, mode="sync", seed=7,
                             optim=Optim(lr=3e-4, betas=(0.8, 0.9)), tags=["a"])
    assert to_dict(cfg)["optim"] == {"lr": 3e-4, "betas": [0.8, 0.9]}


@pytest.mark.parametrize("data,overrides,message", [
    ({"name": "x", "optim": {"lrr": 1}}, [], r"unknown config key optim\.lrr; valid keys here: betas, lr"),
    ({"name": "x"}, ["steps=many"], "steps: expected an integer, got 'many'"),
    ({"name": "x"}, ["mode=fast"], r"mode: 'fast' is not one of \['async', 'sync'\]"),
    ({"name": "x"}, ["optim.betas=[1]"], r"optim.betas: expected 2 items, got 1"),
    ({}, [], "missing required config key name"),
    ({"name": "x"}, ["steps"], "not of the form key=value"),
    ({"name": "x", "steps": 3}, ["steps.sub=1"], "steps is not a mapping"),
    # Non-finite numbers passed every range check after them (a NaN or infinite learning rate
    # or clip turned the weights into NaN in one step).
    ({"name": "x"}, ["optim.lr=.inf"], "optim.lr: expected a finite number, got inf"),
    ({"name": "x"}, ["optim.lr=nan"], "optim.lr: expected a finite number, got nan"),
    ({"name": "x"}, ["optim.lr=1e400"], "optim.lr: expected a finite number, got 1e400"),
    ({"name": "x", "optim": {"lr": 10**400}}, [], "optim.lr: expected a finite number, got 1000"),
    ({"name": "x"}, ["optim.betas=[.nan, 0.9]"], r"optim.betas\[0\]: expected a finite number"),
    # an optional section's own error, not "matches none of Optim | None"
    ({"name": "x", "extra": {"lrr": 1}}, [], r"unknown config key extra\.lrr; valid keys here"),
])
def test_errors_name_the_key(tmp_path, data, overrides, message):
    import yaml

    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message):
        load_config(Experiment, f, overrides)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Experiment, tmp_path / "nope.yaml")
    (tmp_path / "l.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(Experiment, tmp_path / "l.yaml")
    assert from_dict(Experiment, {"name": "n", "seed": None}).seed is None
    # Unknown keys of mixed types (YAML reads `1:` as a number) are named, not a TypeError.
    with pytest.raises(ConfigError, match="unknown config key 1; valid keys here"):
        from_dict(Experiment, {"name": "n", 1: "a", "zz": "b"})


def test_aliases_that_expand_a_config_without_bound_or_into_itself_are_refused(tmp_path):
    # A few lines of nested aliases stand for billions of values; a self-reference for an
    # endless structure: every later pass over the config (checks, copies, JSON) would hang.
    lines = ['name: x', 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 8)}]" for i in range(1, 9)]
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"laughs.yaml: its aliases \(\*name\) expand it to "
                       r"more than 100000 values"):
        load_config(Experiment, laughs)
    itself = tmp_path / "itself.yaml"
    itself.write_text("name: x\ntags: &t [a, *t]\n")
    with pytest.raises(ConfigError, match="an alias at line 2 makes the document contain itself"):
        load_config(Experiment, itself)
    deep = tmp_path / "deep.yaml"  # the parser recursed into a raw RecursionError
    deep.write_text("name: x\ntags: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml: nested too deep to read"):
        load_config(Experiment, deep)
    with pytest.raises(ConfigError, match="override tags: its value is nested too deep"):
        load_config(Experiment, None, ["name=x", "tags=" + "[" * 5000])
    # The same on the command line: a 400-character override was accepted and hung the run's
    # first pass over its config; a self-containing one raised a raw RecursionError.
    laughs_override = "tags=" + "".join(f"- &l{i} [{', '.join([f'*l{i - 1}'] * 8)}]\n"
                                        for i in range(1, 9)).replace("*l0", "lol")
    with pytest.raises(ConfigError, match=r"override tags: its aliases \(\*name\) expand it"):
        load_config(Experiment, None, ["name=x", laughs_override])
    with pytest.raises(ConfigError, match="override tags: an alias at line 1 makes the document "
                                          "contain itself"):
        load_config(Experiment, None, ["name=x", "tags=&t [a, *t]"])
    shared = tmp_path / "shared.yaml"  # aliases as people use them stay fine
    shared.write_text("name: x\ntags: &t [a, b]\noptim: {lr: &lr 0.001}\nextra: {lr: *lr}\n")
    assert load_config(Experiment, shared).extra.lr == 0.001


def test_text_yaml_reads_as_another_type_says_how_to_quote_it():
    with pytest.raises(ConfigError, match=r"name: expected a string, got True \(YAML reads "
                                          r"yes/no.* key='\"yes\"'\)"):
        load_config(Experiment, None, ["name=yes"])
    assert load_config(Experiment, None, ['name="yes"']).name == "yes"
    assert load_config(Experiment, None, ['name=" Answer."']).name == " Answer."


def test_an_unknown_key_points_to_the_section_that_has_it():
    from areal_jax.experiment import ExperimentConfig

    for override, hint in (("trainer.kl_beta=0.1", "did you mean trainer.advantage.kl_beta?"),
                           ("max_staleness=3", "did you mean schedule.max_staleness?"),
                           ("+trainer.lr=1", "drop the '+'")):
        with pytest.raises(ConfigError, match=re.escape(hint)):
            load_config(ExperimentConfig, QUICKSTART, [override])


def test_a_config_given_without_its_flag_says_how(capsys):
    from areal_jax.cli import main

    assert main(["train", "my.yaml", "seed=1"]) == 2
    assert ("the config is named with --config: areal-jax train --config my.yaml"
            in capsys.readouterr().err)
