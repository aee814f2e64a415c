"""CompileOptions (config.py), the one value of how a model compiles: pyproject.toml's
settings fill every field, and every field reaches the compile cache's key, the editable
install's fingerprint and `cuvil compile`'s flags. A field added to CompileOptions fails here
until it has a setting below that changes it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from projects import write_model

from cuvil import cli
from cuvil.build_backend._editable import fingerprint
from cuvil.build_backend.cache import model_key
from cuvil.config import CompileOptions, load_project
from cuvil.errors import ConfigError
from cuvil.toolchains import get_target

PYPROJECT = """\
[project]
name = "tiny-cuvil"
version = "1.0.0"

[tool.cuvil]
package = "tiny"
{settings}
[tool.cuvil.models.net]
source = "models/net.onnx"
{model}
"""

#: per field, (a [tool.cuvil] line, a model table line, the field's value they give): a value
#: other than the default
OTHER = {
    "inputs": ("", 'inputs = { x = ["n", 4] }', {"x": ("n", 4)}),
    "cpu": ('cpu = "haswell"', "", "haswell"),
    "opt_level": ("opt-level = 2", "", 2),
    "quantize": ("", 'quantize = "int8"\ncalibration = "calib:feeds"', "int8"),
    "calibration": ("", 'quantize = "int8"\ncalibration = "calib:other"', "calib:other"),
    "calibration_method": ("", ('quantize = "int8"\ncalibration = "calib:feeds"\n'
                                'calibration-method = "entropy"'), "entropy"),
    "keep_float": ("", 'quantize = "int8"\ncalibration = "calib:feeds"\nkeep-float = ["Relu"]',
                   ("Relu",)),
    "precision": ("", 'precision = "bf16"', "bf16"),
    "transformed_weights": ("", 'transformed-weights = "first-run"', "first-run"),
}
FIELDS = [f.name for f in dataclasses.fields(CompileOptions)]


def project(root: Path, settings: str = "", model: str = "") -> Path:
    write_model(root / "models" / "net.onnx")
    (root / "pyproject.toml").write_text(PYPROJECT.format(settings=settings, model=model))
    return root


def digests(root: Path) -> tuple[str, str]:
    """The model's compile-cache key and the project's editable fingerprint."""
    config = load_project(root, {}, {})
    target = get_target("x86_64-linux")
    return (model_key(config, config.models[0], target),
            fingerprint(config, target.name, {}))


def test_every_field_has_a_setting_here() -> None:
    assert sorted(OTHER) == sorted(FIELDS), "give the new CompileOptions field a line in OTHER"


@pytest.mark.parametrize("name", FIELDS)
def test_each_setting_fills_its_field_and_changes_the_key_and_the_fingerprint(
        name: str, tmp_path: Path) -> None:
    # quantized on both sides where the field only means something then
    needs_int8 = name in ("calibration", "calibration_method", "keep_float")
    base = project(tmp_path / "base",
                   model='quantize = "int8"\ncalibration = "calib:feeds"' if needs_int8 else "")
    settings, model, value = OTHER[name]
    other = project(tmp_path / "other", settings, model)
    config = load_project(other, {}, {})
    options = config.compile_options(config.models[0])
    assert getattr(options, name) == value
    key, stamp = digests(base)
    other_key, other_stamp = digests(other)
    assert other_key != key
    assert other_stamp != stamp


def test_the_key_state_is_every_field_as_json() -> None:
    # feeds given in process are no JSON: the state names only an entry point
    for calibration, named in (("calib:feeds", "calib:feeds"), ([{"x": np.zeros(4)}], None)):
        state = CompileOptions(inputs={"x": ("n", 4)}, quantize="int8", calibration=calibration,
                               keep_float=("Relu",)).key_state()
        assert list(state) == FIELDS
        assert json.loads(json.dumps(state)) == state
        assert state["inputs"] == {"x": ["n", 4]} and state["calibration"] == named


def test_cuvil_compile_has_a_flag_for_every_field() -> None:
    args = cli._parser().parse_args([
        "compile", "m.onnx", "--input", "x=n,4", "--cpu", "haswell", "-O", "2", "--quantize",
        "int8", "--calibration", "calib:other", "--calibration-method", "entropy",
        "--keep-float", "Relu", "--precision", "bf16", "--transformed-weights", "first-run"])
    options = cli.compile_options(args)
    assert {name: getattr(options, name) for name in FIELDS} == {
        name: value for name, (_, _, value) in OTHER.items()}
    defaults = cli.compile_options(cli._parser().parse_args(["compile", "m.onnx"]))
    assert defaults == CompileOptions()


@pytest.mark.parametrize(("options", "message"), [
    (CompileOptions(precision="fp8"), "model m: precision = 'fp8' is not one of"),
    (CompileOptions(opt_level=4), "model m: opt-level = 4 is not one of"),
    (CompileOptions(quantize="int8"), 'quantize = "int8" needs calibration data'),
    (CompileOptions(keep_float=("Relu",)), "keep-float given, but quantize is \"none\""),
])
def test_check_names_the_model_and_the_setting(options: CompileOptions, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        options.check("m")
