"""One source per default (issue 35 item 5): every default lives in the schema (trainer/config/schema.py)
alone. The root config sets no key whose default the schema already holds, a config group's option
sets only the keys that make it that option, the model's GPTConfig takes the schema's defaults, and
a parallel mode's name is one name: its YAML's stem, the YAML's `mode:` and its Strategy's `name`."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from trainer.config.compose import compose
from trainer.config.schema import CONF_DIR, GROUP_SCHEMAS, Config, ModelConfig, TokenizerConfig
from trainer.io import dotted_keys
from trainer.model.config import NOT_SHAPE, GPTConfig
from trainer.parallel import STRATEGIES

# The groups whose options are merged onto a schema dataclass, and the key that names an option.
OPTION_SCHEMAS = {**GROUP_SCHEMAS, "tokenizer": TokenizerConfig}
NAME_KEY = {"parallel": "mode"}
OPTIONS = sorted((group, path.stem) for group in OPTION_SCHEMAS for path in (CONF_DIR / group).glob("*.yaml"))


def test_the_root_config_sets_only_what_the_schema_cannot():
    """conf/config.yaml picks the groups and sets the launch keys read from the environment
    (interpolations a dataclass default cannot hold); every other default is the schema's."""
    root = OmegaConf.load(CONF_DIR / "config.yaml")
    assert set(root) - {"defaults", "hydra"} == {"launch"}
    assert set(root.launch) == {"rdzv_endpoint", "rdzv_id"}
    schema, composed = OmegaConf.structured(Config), compose([])
    for section in ("train", "checkpoint", "eval"):
        assert OmegaConf.to_container(composed[section]) == OmegaConf.to_container(schema[section]), section


def test_every_default_outside_the_groups_is_the_schemas_leaf_by_leaf(monkeypatch):
    """The default run's config, resolved, against the schema: every key the schema gives a value
    outside the model/data/optim/parallel groups (whose options are checked below) has that value,
    the launch keys conf/config.yaml reads from the environment included (when it is unset)."""
    for name in ("DTRAIN_RDZV_ENDPOINT", "DTRAIN_RDZV_ID"):
        monkeypatch.delenv(name, raising=False)
    schema = dotted_keys(OmegaConf.to_container(OmegaConf.structured(Config)))
    composed = dotted_keys(OmegaConf.to_container(compose([]), resolve=True))
    compared = {key for key in schema if key.split(".")[0] not in GROUP_SCHEMAS}
    assert {"train.max_steps", "train.val_interval", "launch.rdzv_endpoint", "tokenizer.name", "world"} <= compared
    assert {key: composed[key] for key in compared} == {key: schema[key] for key in compared}


@pytest.mark.parametrize("group,option", OPTIONS)
def test_an_option_sets_only_the_keys_that_make_it_that_option(group, option):
    """A key a group's option sets to the value the schema already gives would be a second source
    of that default (one that stays behind when the schema's changes): every key an option sets
    differs from the schema's default, but the key naming the option."""
    schema = dotted_keys(OmegaConf.to_container(OmegaConf.structured(OPTION_SCHEMAS[group])))
    option_yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    option_yaml.pop("defaults", None)  # another option it builds on (fineweb_edu: hf), checked on its own
    values = dotted_keys(option_yaml)
    restated = {key: value for key, value in values.items()
                if key != NAME_KEY.get(group, "name") and key in schema and value == schema[key]}
    assert not restated, f"conf/{group}/{option}.yaml restates the schema's defaults {restated}"
    assert set(values) <= set(schema), f"conf/{group}/{option}.yaml sets keys the schema lacks"


@pytest.mark.parametrize("group", ["model", "data", "optim"])
def test_an_option_is_named_by_its_yaml_stem(group):
    """data=hf and data=text name their dataset after what they read (an interpolation), every other
    option by its stem."""
    names = {path.stem: OmegaConf.load(path)._get_node("name")._value() for path in (CONF_DIR / group).glob("*.yaml")}
    derived = {stem for stem, name in names.items() if str(name).startswith("${")}
    assert derived == ({"hf", "text"} if group == "data" else set()), derived
    assert names and all(stem == name for stem, name in names.items() if stem not in derived), names


def test_the_models_defaults_are_the_schemas():
    """GPTConfig has no defaults of its own: each is ModelConfig's, resolved (vocab_size is the
    default tokenizer's size); the schema's model section is exactly conf/model/tiny.yaml's model."""
    schema = OmegaConf.structured(Config)
    schema.model = OmegaConf.structured(ModelConfig)
    model_defaults = OmegaConf.to_container(schema.model, resolve=True)
    # a nested group (model.moe): its default's fields
    gpt_defaults = {f.name: f.default if f.default is not dataclasses.MISSING
                    else dataclasses.asdict(f.default_factory()) for f in dataclasses.fields(GPTConfig)}
    assert set(gpt_defaults) == set(model_defaults) - set(NOT_SHAPE) and "attention" in NOT_SHAPE
    assert gpt_defaults == {key: model_defaults[key] for key in gpt_defaults}
    tiny = compose(["model=tiny", "tokenizer=gpt2"]).model
    assert OmegaConf.to_container(tiny, resolve=True) == model_defaults
    assert GPTConfig.from_cfg(tiny) == GPTConfig()


def test_a_modes_name_is_its_yaml_stem_its_mode_key_and_its_strategy_name():
    stems = {path.stem: OmegaConf.load(path).mode for path in (CONF_DIR / "parallel").glob("*.yaml")}
    assert all(stem == mode for stem, mode in stems.items()), stems
    assert set(stems) == set(STRATEGIES)
    assert all(cls.name == name for name, cls in STRATEGIES.items())
