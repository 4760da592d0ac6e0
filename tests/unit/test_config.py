"""Configuration: the repository's configs load, and every bad value fails with its field path and what is allowed."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import DEFAULT_CONFIG_DIR, ConfigError, load_config, parse_config, raw_config
from tests.unit.builders import config


def base() -> dict[str, Any]:
    return copy.deepcopy(raw_config())


def error_of(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(raw)
    return str(exc.value)


def test_repository_config_loads_with_two_racks_of_four_h100_nodes() -> None:
    cfg = config()
    assert cfg.rack_names() == ("r0", "r1")
    assert [n.name for n in cfg.nodes()] == [f"r{r}-n{i}" for r in range(2) for i in range(4)]
    assert cfg.racks_serving("qwen2-7b") == ("r0", "r1")
    assert cfg.rack_of("r1-n2") == "r1"
    assert cfg.node_mem_budget_kb("r0-n0") == pytest.approx(72e6)  # 0.9 x 80 GB, in KB
    assert cfg.policies.batcher.window_ms == 100


def test_unknown_gpu_type_names_the_node_and_lists_allowed_types() -> None:
    raw = base()
    raw["cluster"]["racks"][1]["node"]["gpu"] = "b200-192gb"
    msg = error_of(raw)
    assert "r1-n0" in msg and "unknown gpu 'b200-192gb'" in msg
    assert "allowed: a100-80gb, h100-80gb, h200-141gb" in msg


def test_unknown_model_on_a_node_lists_allowed_models() -> None:
    raw = base()
    raw["cluster"]["racks"][0]["node"]["models"] = ["qwen3-8b"]
    msg = error_of(raw)
    assert "unknown model 'qwen3-8b'" in msg and "qwen2-7b" in msg


def test_negative_memory_names_the_gpu_field_path() -> None:
    raw = base()
    raw["gpus"]["h100-80gb"]["memory_gb"] = -80
    msg = error_of(raw)
    assert "gpus.h100-80gb.memory_gb" in msg
    assert "greater than 0" in msg and "(got -80)" in msg


def test_unknown_policy_name_lists_the_allowed_literal() -> None:
    raw = base()
    raw["policies"]["router"]["policy"] = "foo"
    msg = error_of(raw)
    assert "policies.router.policy" in msg
    assert "'rack_affinity'" in msg and "(got 'foo')" in msg


def test_unknown_node_policy_name_lists_all_seven_policies() -> None:
    raw = base()
    raw["policies"]["node_selection"]["policy"] = "weighted-random"  # the foundation's old name
    msg = error_of(raw)
    assert "policies.node_selection.policy" in msg and "(got 'weighted-random')" in msg
    for name in ("round_robin", "random", "least_outstanding", "power_of_two", "static_weight", "weighted",
                 "kv_aware"):
        assert f"'{name}'" in msg


def test_unknown_name_in_allowed_overrides_is_rejected_with_its_index() -> None:
    raw = base()
    raw["policies"]["node_selection"]["allowed_overrides"] = ["random", "fastest"]
    msg = error_of(raw)
    assert "policies.node_selection.allowed_overrides.1" in msg and "'fastest'" in msg


def test_repository_policies_name_rack_affinity_and_work_aware_by_default() -> None:
    pol = config().policies
    assert pol.router.policy == "rack_affinity"
    assert pol.router.prefix_aware
    assert pol.node_selection.policy == "work_aware"
    assert pol.profiling.estimator == "shape"
    assert pol.node_selection.allow_request_override
    assert pol.profiling.token_rates.cjk == 1.4


@pytest.mark.parametrize(
    ("where", "path"),
    [
        (lambda r: r["policies"]["batcher"], "policies.batcher.windw_ms"),
        (lambda r: r["gpus"]["a100-80gb"], "gpus.a100-80gb.windw_ms"),
        (lambda r: r["cluster"]["racks"][0], "cluster.racks.0.windw_ms"),
        (lambda r: r["gateway"]["auth"], "gateway.auth.windw_ms"),
        (lambda r: r["policies"]["node_selection"]["kv_aware"], "policies.node_selection.kv_aware.windw_ms"),
        (lambda r: r, "windw_ms"),
    ],
)
def test_extra_unknown_field_is_forbidden_at_every_level(where: Any, path: str) -> None:
    raw = base()
    where(raw)["windw_ms"] = 50
    msg = error_of(raw)
    assert path in msg and "Extra inputs are not permitted" in msg


def test_rack_with_both_nodes_and_node_count_is_rejected() -> None:
    raw = base()
    raw["cluster"]["racks"][0]["nodes"] = [{"name": "x0", "gpu": "h100-80gb", "models": ["qwen2-7b"]}]
    msg = error_of(raw)
    assert "cluster.racks.0" in msg and "either `nodes` or `node_count` + `node`, not both" in msg


def test_rack_with_neither_form_is_rejected() -> None:
    raw = base()
    del raw["cluster"]["racks"][0]["node_count"]
    assert "a rack needs `nodes` or both `node_count` and `node`" in error_of(raw)


def test_duplicate_node_names_across_racks_are_rejected() -> None:
    raw = base()
    raw["cluster"]["racks"].append(
        {"name": "r2", "nodes": [{"name": "r0-n1", "gpu": "h200-141gb", "models": ["qwen2-7b"]}]}
    )
    msg = error_of(raw)
    assert "node names must be unique" in msg and "r0-n1" in msg


def test_duplicate_rack_names_are_rejected() -> None:
    raw = base()
    raw["cluster"]["racks"][1]["name"] = "r0"
    assert "rack names must be unique" in error_of(raw)


def test_72b_model_on_one_80gb_gpu_at_tp1_asks_to_raise_tp() -> None:
    raw = base()
    raw["cluster"]["racks"][0]["node"]["models"] = ["qwen2-72b"]
    msg = error_of(raw)
    assert "qwen2-72b needs 145 GB of weights per GPU at tp=1" in msg
    assert "raise tp to at least 3" in msg
    raw["cluster"]["racks"][0]["node"]["tp"] = 3
    assert parse_config(raw).node("r0-n0").tp == 3


def test_the_tp_suggested_for_a_too_large_model_is_enough() -> None:
    raw = base()
    raw["policies"]["batcher"]["mem_budget_fraction"] = 0.5
    raw["cluster"]["racks"][0]["node"]["models"] = ["qwen2-72b"]
    msg = error_of(raw)
    suggested = int(msg.split("raise tp to at least ")[1].split()[0])
    raw["cluster"]["racks"][0]["node"]["tp"] = suggested
    parse_config(raw)


def test_override_file_merges_over_the_repository_config(tmp_path: Path) -> None:
    over = tmp_path / "fast.yaml"
    over.write_text(yaml.safe_dump({"policies": {"batcher": {"window_ms": 25}}}))
    cfg = load_config(DEFAULT_CONFIG_DIR, [over])
    assert cfg.policies.batcher.window_ms == 25
    assert cfg.policies.batcher.age_after_windows == config().policies.batcher.age_after_windows  # siblings kept
    assert cfg.cluster == config().cluster


def test_override_file_with_a_bad_value_names_the_field_and_the_file(tmp_path: Path) -> None:
    over = tmp_path / "bad.yaml"
    over.write_text(yaml.safe_dump({"policies": {"batcher": {"window_ms": 0}}}))
    with pytest.raises(ConfigError) as exc:
        load_config(DEFAULT_CONFIG_DIR, [over])
    assert "policies.batcher.window_ms" in str(exc.value) and str(over) in str(exc.value)


def test_override_file_with_unknown_top_level_key_is_rejected(tmp_path: Path) -> None:
    over = tmp_path / "typo.yaml"
    over.write_text(yaml.safe_dump({"policy": {"seed": 1}}))
    with pytest.raises(ConfigError, match="unknown top-level keys"):
        load_config(DEFAULT_CONFIG_DIR, [over])


def test_invalid_yaml_gives_config_error_naming_the_file(tmp_path: Path) -> None:
    over = tmp_path / "broken.yaml"
    over.write_text("policies: {batcher: [window_ms: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(DEFAULT_CONFIG_DIR, [over])
    assert str(over) in str(exc.value) and "not valid YAML" in str(exc.value)


def test_missing_override_file_gives_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.yaml"):
        load_config(DEFAULT_CONFIG_DIR, [tmp_path / "nope.yaml"])


def test_kv_bytes_per_token_of_qwen2_7b_is_2_x_layers_x_kv_heads_x_head_dim_x_2_bytes() -> None:
    assert config().models["qwen2-7b"].kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344


@pytest.mark.parametrize(("model", "published", "tolerance"), [("llama-2-7b", 6.74e9, 0.02),
                                                                ("qwen2-72b", 72.7e9, 0.03),
                                                                ("qwen2-7b", 7.6e9, 0.03),
                                                                ("llama-2-70b", 69.0e9, 0.03)])
def test_parameter_count_from_shape_matches_the_published_size(model: str, published: float, tolerance: float) -> None:
    params = config().models[model].params
    assert math.isclose(params, published, rel_tol=tolerance), f"{model}: {params / 1e9:.2f}e9"


def test_model_whose_hidden_size_is_not_a_multiple_of_heads_is_rejected() -> None:
    raw = base()
    raw["models"]["qwen2-7b"]["heads"] = 27
    assert "models.qwen2-7b" in error_of(raw) and "multiple of heads" in error_of(raw)


# -- model-aware placement, token rates and the gateway section ---------------------------------------------------


def test_model_on_a_gpu_outside_its_gpu_pool_names_the_node_and_the_pool() -> None:
    raw = base()
    raw["models"]["qwen2-7b"]["gpu_pool"] = ["a100-80gb"]
    msg = error_of(raw)
    assert "cluster.racks.0.node.gpu" in msg and "r0-n0" in msg
    assert "qwen2-7b is placed on a100-80gb only (models.qwen2-7b.gpu_pool), not h100-80gb" in msg


def test_unknown_gpu_in_a_gpu_pool_lists_the_known_gpus() -> None:
    raw = base()
    raw["models"]["qwen2-7b"]["gpu_pool"] = ["h100-80gb", "tpu-v5"]
    msg = error_of(raw)
    assert "models.qwen2-7b.gpu_pool: unknown gpu 'tpu-v5'" in msg
    assert "allowed: a100-80gb, h100-80gb, h200-141gb" in msg


def test_model_without_gpu_pool_may_run_on_any_gpu() -> None:
    raw = base()
    assert "gpu_pool" not in raw["models"]["llama-2-7b"]
    raw["cluster"]["racks"][0]["node"] = {"gpu": "a100-80gb", "tp": 1, "models": ["llama-2-7b"]}
    assert parse_config(raw).node("r0-n0").models == ("llama-2-7b",)


def test_nodes_serving_a_model_follow_the_racks_models() -> None:
    raw = base()
    raw["cluster"]["racks"][1]["node"] = {"gpu": "h100-80gb", "tp": 4, "models": ["qwen2-72b"]}
    cfg = parse_config(raw)
    assert cfg.nodes_serving("qwen2-72b") == tuple(f"r1-n{i}" for i in range(4))
    assert cfg.nodes_serving("qwen2-7b", "r1") == ()
    assert cfg.racks_serving("qwen2-7b") == ("r0",)
    assert cfg.node_mem_budget_kb("r1-n0") == pytest.approx(4 * 72e6)  # tp=4: four GPUs' memory


def test_model_token_rates_override_the_profiling_default() -> None:
    raw = base()
    raw["models"]["qwen2-7b"]["token_rates"] = {"cjk": 1.1, "latin": 3.6, "code": 2.7}
    cfg = parse_config(raw)
    assert (cfg.token_rates("qwen2-7b").cjk, cfg.token_rates("qwen2-7b").code) == (1.1, 2.7)
    assert cfg.token_rates("llama-2-7b") == cfg.policies.profiling.token_rates


@pytest.mark.parametrize(("rates", "path"), [({"cjk": 0}, "cjk"), ({"latin": -1.0}, "latin"), ({"code": 99}, "code")])
def test_token_rates_out_of_bounds_name_the_field(rates: dict[str, float], path: str) -> None:
    raw = base()
    raw["models"]["qwen2-7b"]["token_rates"] = rates
    assert f"models.qwen2-7b.token_rates.{path}" in error_of(raw)


def test_gateway_section_is_loaded_from_gateway_yaml() -> None:
    gw = config().gateway
    assert (gw.host, gw.port, gw.auth.mode, gw.auth.secret_env) == ("127.0.0.1", 8000, "hs256", "RACKFLOW_JWT_SECRET")
    assert gw.max_body_bytes == 4 * 1024 * 1024


@pytest.mark.parametrize(("field", "value", "expect"), [
    (("port",), 70_000, "gateway.port"),
    (("auth", "mode"), "basic", "gateway.auth.mode"),
    (("max_n",), 129, "gateway.max_n"),
])
def test_bad_gateway_value_names_its_field_path(field: tuple[str, ...], value: object, expect: str) -> None:
    raw = base()
    where = raw["gateway"]
    for key in field[:-1]:
        where = where[key]
    where[field[-1]] = value
    assert expect in error_of(raw)


def test_override_file_may_set_the_gateway_and_lists_it_among_allowed_keys(tmp_path: Path) -> None:
    over = tmp_path / "gw.yaml"
    over.write_text(yaml.safe_dump({"gateway": {"port": 0, "auth": {"mode": "none"}}}))
    cfg = load_config(DEFAULT_CONFIG_DIR, [over])
    assert (cfg.gateway.port, cfg.gateway.auth.mode) == (0, "none")
    assert cfg.gateway.auth.secret_env == config().gateway.auth.secret_env  # siblings kept
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"gatway": {"port": 1}}))
    with pytest.raises(ConfigError, match="allowed: gpus, models, cluster, policies, gateway"):
        load_config(DEFAULT_CONFIG_DIR, [typo])


@pytest.mark.parametrize("example", sorted((DEFAULT_CONFIG_DIR / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_override_files_load(example: Path) -> None:
    cfg = load_config(DEFAULT_CONFIG_DIR, [example])
    for node in cfg.nodes():
        for m in node.models:
            pool = cfg.models[m].gpu_pool
            assert not pool or node.gpu in pool


@pytest.mark.parametrize("weight", [-1.0, math.inf, math.nan], ids=["negative", "inf", "nan"])
def test_static_weight_out_of_bounds_is_rejected_naming_the_field(weight: float) -> None:
    raw = base()
    raw["policies"]["node_selection"]["static_weights"] = {"r0-n0": weight}
    assert "policies.node_selection.static_weights" in error_of(raw)


def test_overlay_builds_a_variant_without_a_file_and_refuses_unknown_sections() -> None:
    from pipeline.config import TOP_LEVEL_KEYS, ConfigError, overlay, parse_config, raw_config

    raw = raw_config()
    small = {"cluster": {"racks": [{"name": "r0", "node_count": 1, "node": {"gpu": "h100-80gb", "tp": 1,
                                                                    "models": ["qwen2-7b"]}}]},
             "policies": {"seed": 7, "batcher": {"window_ms": 25}}}
    cfg = parse_config(overlay(raw, small))
    assert [n.name for n in cfg.nodes()] == ["r0-n0"] and cfg.policies.seed == 7
    assert cfg.policies.batcher.window_ms == 25
    assert raw == raw_config(), "overlay must not modify its input"
    assert "gateway" in TOP_LEVEL_KEYS
    with pytest.raises(ConfigError, match=r"unknown top-level keys \['polices'\]"):
        overlay(raw, {"polices": {}})


def test_an_overlay_file_for_role_processes_is_validated_before_it_is_written(tmp_path: Path) -> None:
    from pipeline.config import ConfigError, load_config
    from workers.local.launcher import config_overlay_file

    path = tmp_path / "over.yaml"
    cfg = config_overlay_file(path, {"policies": {"worker": {"token_flush_ms": 20}}})
    assert cfg.policies.worker.token_flush_ms == 20
    assert load_config(overrides=[path]) == cfg, "the processes must load the config the caller was given"
    bad = tmp_path / "bad.yaml"
    with pytest.raises(ConfigError, match="token_flush_ms"):
        config_overlay_file(bad, {"policies": {"worker": {"token_flush_ms": -1}}})
    assert not bad.exists()
