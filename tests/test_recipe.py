from pathlib import Path

import pytest

from hf_fp8 import E4M3, E5M2, RECIPES, Fp8Recipe
from hf_fp8.recipe import RECIPE_PURPOSES

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_transformer_engine_delayed_scaling():
    r = Fp8Recipe()
    assert (r.format, r.scaling, r.margin, r.amax_history_len, r.amax_compute_algo, r.interval) == (
        "hybrid",
        "delayed",
        0,
        1024,
        "max",
        1,
    )
    assert r.enabled and not r.fp8_weights and not r.use_during_eval
    assert r.modules_to_not_convert == () and not r.convert_lm_head


@pytest.mark.parametrize(
    ("fmt", "forward", "backward"),
    [("hybrid", E4M3, E5M2), ("e4m3", E4M3, E4M3), ("e5m2", E5M2, E5M2)],
)
def test_format_picks_forward_and_backward_formats(fmt, forward, backward):
    r = Fp8Recipe(format=fmt)
    assert r.forward_format is forward and r.backward_format is backward


def test_recipe_is_frozen_and_replace_validates():
    r = Fp8Recipe()
    with pytest.raises(AttributeError):
        r.margin = 3
    assert r.replace(margin=2).margin == 2
    with pytest.raises(ValueError, match="margin"):
        r.replace(margin=-1)


@pytest.mark.parametrize(
    ("key", "good", "bad", "message"),
    [
        ("enabled", False, "yes", "true or false"),
        ("format", "E4M3", "fp16", r"one of \['hybrid', 'e4m3', 'e5m2'\]"),
        ("scaling", "current", "per-row", r"one of \['delayed', 'current', 'rowwise', 'rowwise_gw_hp', 'b"),
        ("margin", 2, -1, "integer from 0 to 8"),
        ("margin", 1, 0.5, "integer from 0 to 8"),
        ("margin", 8, 9, "integer from 0 to 8, got 9; each step of margin gives up one binade"),
        ("amax_history_len", 16, 0, "integer from 1 to 65536"),
        ("amax_history_len", 16, True, "integer from 1 to 65536"),
        ("amax_compute_algo", "most_recent", "mean", r"one of \['max', 'most_recent'\]"),
        ("interval", 10, 0, "integer from 1 to 100000"),
        ("fp8_weights", True, 1, "true or false"),
        ("fp8_all_gather", True, "on", "true or false"),
        ("modules_to_not_convert", ["lm_head", "*.gate"], [3], "list of module name patterns"),
        ("convert_lm_head", True, "no", r"true \(the head's three GEMMs in FP8\), false \(none\) or 'ba"),
        ("convert_lm_head", "Backward", 1, "or 'backward'"),
        ("use_during_eval", True, None, "true or false"),
    ],
)
def test_every_field_accepts_good_and_names_bad_values(key, good, bad, message):
    recipe = Fp8Recipe.from_dict({key: good})
    expected = good.lower() if isinstance(good, str) else good
    if key == "modules_to_not_convert":
        expected = tuple(good)
    assert getattr(recipe, key) == expected
    with pytest.raises(ValueError, match=message) as info:
        Fp8Recipe.from_dict({key: bad})
    assert repr(key) in str(info.value) and repr(bad) in str(info.value)


def test_unknown_key_names_key_and_suggests_closest():
    with pytest.raises(
        ValueError, match=r"unknown recipe key 'amax_histroy_len'.*did you mean 'amax_history_len'"
    ):
        Fp8Recipe.from_dict({"amax_histroy_len": 16})


def test_non_mapping_is_refused():
    with pytest.raises(ValueError, match="mapping"):
        Fp8Recipe.from_dict(["format", "hybrid"])


def test_a_retired_key_loads_with_a_warning_that_says_what_replaced_it():
    """Recipes and checkpoints written before the model's inputs stopped being padded still load."""
    with pytest.warns(FutureWarning, match=r"'pad_to_multiple' is ignored: each FP8 layer pads"):
        recipe = Fp8Recipe.from_dict({"pad_to_multiple": 16, "margin": 1})
    assert recipe == Fp8Recipe(margin=1)


def test_nemo_keys():
    r = Fp8Recipe.from_dict(
        {
            "fp8": True,
            "fp8_hybrid": True,
            "fp8_e4m3": False,
            "fp8_margin": 1,
            "fp8_amax_history_len": 32,
            "fp8_amax_compute_algo": "most_recent",
            "fp8_params": True,
            "fp8_interval": 4,
        }
    )
    assert r == Fp8Recipe(
        format="hybrid",
        margin=1,
        amax_history_len=32,
        amax_compute_algo="most_recent",
        fp8_weights=True,
        interval=4,
    )
    assert Fp8Recipe.from_dict({"fp8_e4m3": True}).format == "e4m3"
    assert Fp8Recipe.from_dict({"fp8": "e4m3"}).format == "e4m3"
    assert Fp8Recipe.from_dict({"fp8": False}).enabled is False


def test_h200_guide_keys():
    r = Fp8Recipe.from_dict({"use_fp8": True, "fp8_format": "hybrid", "fp8_margin": 1, "fp8_interval": 10})
    assert (r.enabled, r.format, r.margin, r.interval) == (True, "hybrid", 1, 10)


def test_conflicting_keys_are_an_error():
    with pytest.raises(ValueError, match="'fp8_hybrid' and 'fp8_e4m3' disagree on format"):
        Fp8Recipe.from_dict({"fp8_hybrid": True, "fp8_e4m3": True})
    with pytest.raises(ValueError, match="disagree on margin"):
        Fp8Recipe.from_dict({"margin": 0, "fp8_margin": 2})
    # The same value twice is not a conflict, whatever its spelling.
    assert Fp8Recipe.from_dict({"format": "HYBRID", "fp8_format": "hybrid"}).format == "hybrid"


def test_alias_error_names_the_key_the_user_wrote():
    with pytest.raises(ValueError, match=r"'margin'.*given as 'fp8_margin'"):
        Fp8Recipe.from_dict({"fp8_margin": "big"})
    with pytest.raises(ValueError, match="'fp8_hybrid' must be true or false"):
        Fp8Recipe.from_dict({"fp8_hybrid": "yes"})


def test_from_dict_builds_on_base():
    base = Fp8Recipe(scaling="current")
    assert Fp8Recipe.from_dict({"margin": 1}, base=base) == Fp8Recipe(scaling="current", margin=1)


def test_yaml_round_trip(tmp_path):
    r = Fp8Recipe(format="e4m3", margin=2, modules_to_not_convert=("lm_head",), use_during_eval=True)
    path = tmp_path / "r.yaml"
    text = r.to_yaml(path)
    assert path.read_text() == text
    assert Fp8Recipe.from_yaml(path) == r


def test_yaml_section_of_larger_config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("learning_rate: 0.001\nfp8:\n  fp8_format: e4m3\n  fp8_margin: 1\n")
    assert Fp8Recipe.from_yaml(path, section="fp8") == Fp8Recipe(format="e4m3", margin=1)
    with pytest.raises(ValueError, match="no section 'precision'"):
        Fp8Recipe.from_yaml(path, section="precision")


def test_yaml_that_does_not_parse_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("format: hybrid\nmargin: [1, 2\nscaling: delayed\n")
    with pytest.raises(ValueError) as info:
        Fp8Recipe.from_yaml(path)
    message = str(info.value)
    assert str(path) in message and "line 3" in message and "not valid YAML" in message


def test_yaml_value_error_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("format: fp4\n")
    with pytest.raises(ValueError, match=rf"{path}: recipe key 'format'"):
        Fp8Recipe.from_yaml(path)


def test_missing_yaml_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read FP8 recipe file"):
        Fp8Recipe.from_yaml(tmp_path / "nope.yaml")


def test_empty_yaml_is_the_default_recipe(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert Fp8Recipe.from_yaml(path) == Fp8Recipe()


def test_from_env_reads_accelerate_variables():
    env = {
        "ACCELERATE_FP8_FORMAT": "E4M3",
        "ACCELERATE_FP8_MARGIN": "1",
        "ACCELERATE_FP8_INTERVAL": "2",
        "ACCELERATE_FP8_AMAX_HISTORY_LEN": "64",
        "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": "most_recent",
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "true",
        "ACCELERATE_FP8_OVERRIDE_FPROP": "false",
    }
    assert Fp8Recipe.from_env(env) == Fp8Recipe(
        format="e4m3",
        margin=1,
        interval=2,
        amax_history_len=64,
        amax_compute_algo="most_recent",
        use_during_eval=True,
    )
    assert Fp8Recipe.from_env({}) == Fp8Recipe()


def test_from_env_errors_name_the_variable():
    with pytest.raises(ValueError, match="ACCELERATE_FP8_MARGIN='one'"):
        Fp8Recipe.from_env({"ACCELERATE_FP8_MARGIN": "one"})
    with pytest.raises(ValueError, match=r"ACCELERATE_FP8_.*'format'"):
        Fp8Recipe.from_env({"ACCELERATE_FP8_FORMAT": "MXFP8"})
    with pytest.raises(ValueError, match=r"ACCELERATE_FP8_OVERRIDE_WGRAD.*modules_to_not_convert"):
        Fp8Recipe.from_env({"ACCELERATE_FP8_OVERRIDE_WGRAD": "1"})


def test_named_recipes_match_shipped_yaml_files():
    files = {p.stem: p for p in (REPO / "recipes").glob("*.yaml")}
    assert (
        set(files)
        == set(RECIPES)
        == {
            "hybrid-delayed",
            "head-backward",
            "current-scaling",
            "conservative",
            "lora-fp8",
            "fsdp-fp8",
            "rowwise",
            "rowwise-gw-hp",
            "block",
            "block-head",
            "lora-fp8-block",
            "reference-fp8",
            "backward-fp8",
        }
    )
    for name, path in files.items():
        assert Fp8Recipe.from_yaml(path) == Fp8Recipe.named(name), name
    assert set(RECIPE_PURPOSES) == set(RECIPES), "every named recipe says what it is for"
    assert Fp8Recipe.named("conservative").margin == 1
    assert Fp8Recipe.named("lora-fp8").fp8_weights
    assert Fp8Recipe.named("lora-fp8-block") == Fp8Recipe.named("block").replace(
        fp8_weights=True, convert_experts=True
    )
    assert Fp8Recipe.named("fsdp-fp8").fp8_all_gather
    assert Fp8Recipe.named("current-scaling").scaling == "current"
    assert Fp8Recipe.named("head-backward") == Fp8Recipe(convert_lm_head="backward")
    assert Fp8Recipe.named("block-head") == Fp8Recipe.named("block").replace(convert_lm_head=True)
    with pytest.raises(ValueError, match="unknown recipe 'fast'"):
        Fp8Recipe.named("fast")


def test_fp8_all_gather_needs_one_scale_per_weight():
    with pytest.raises(ValueError, match=r"fp8_all_gather casts each weight with one scale.*'rowwise'"):
        Fp8Recipe(format="e4m3", scaling="rowwise", fp8_all_gather=True)
    assert Fp8Recipe(scaling="current", fp8_all_gather=True).fp8_all_gather
