"""One source per default (issue 35 item 5): the root config sets no key whose default the schema
already holds, and a parallel mode's name is one name: its YAML's stem, the YAML's `mode:` and its
Strategy's `name`."""

from __future__ import annotations

from omegaconf import OmegaConf

from trainer.config.compose import compose
from trainer.config.schema import CONF_DIR, Config
from trainer.parallel import STRATEGIES


def test_the_root_config_sets_only_what_the_schema_cannot():
    """conf/config.yaml picks the groups and sets the launch keys read from the environment
    (interpolations a dataclass default cannot hold); every other default is the schema's."""
    root = OmegaConf.load(CONF_DIR / "config.yaml")
    assert set(root) - {"defaults", "hydra"} == {"launch"}
    assert set(root.launch) == {"rdzv_endpoint", "rdzv_id"}
    schema, composed = OmegaConf.structured(Config), compose([])
    for section in ("train", "checkpoint", "eval"):
        assert OmegaConf.to_container(composed[section]) == OmegaConf.to_container(schema[section]), section


def test_a_modes_name_is_its_yaml_stem_its_mode_key_and_its_strategy_name():
    stems = {path.stem: OmegaConf.load(path).mode for path in (CONF_DIR / "parallel").glob("*.yaml")}
    assert all(stem == mode for stem, mode in stems.items()), stems
    assert set(stems) == set(STRATEGIES)
    assert all(cls.name == name for name, cls in STRATEGIES.items())
