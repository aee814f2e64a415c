from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from cuvil.config import load_project, normalize_package_name, read_pyproject
from cuvil.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

PROJECT = '[project]\nname = "digits-cuvil"\nversion = "1.0.0"\n'
MODEL = '[tool.cuvil.models.classifier]\nsource = "models/classifier.onnx"\n'


def make_project(root: Path, text: str = PROJECT + MODEL, files=("models/classifier.onnx",)):
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(text, encoding="utf-8")
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"not parsed by config")
    return root


def config_error(root: Path, config_settings=None, environ=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_project(root, config_settings, environ or {})
    return str(info.value)


def test_defaults(tmp_path):
    cfg = load_project(make_project(tmp_path), environ={})
    root = tmp_path.resolve()
    assert cfg.root == root
    assert cfg.pyproject == root / "pyproject.toml"
    assert cfg.project == {"name": "digits-cuvil", "version": "1.0.0"}
    assert (cfg.name, cfg.package, cfg.targets) == ("digits-cuvil", "digits", ())
    (model,) = cfg.models
    assert model.name == "classifier"
    assert model.source == root / "models/classifier.onnx"
    assert (model.inputs, model.quantize, model.calibration) == ({}, "none", None)
    assert (model.precision, model.transformed_weights) == ("float32", "library")
    s = cfg.settings
    assert (s.target, s.cpu, s.opt_level, s.verbose) == (None, None, 3, False)
    assert s.build_dir == root / "build/cuvil"


def test_full_example(tmp_path):
    text = PROJECT + (
        '[tool.cuvil]\npackage = "digits"\n'
        'targets = ["x86_64-linux", "aarch64-linux", "universal2-macos"]\n'
        "[tool.cuvil.models.classifier]\n"
        'source = "models/classifier.onnx"\n'
        'inputs = { image = ["batch", 1, 8, 8] }\n'
        'quantize = "int8"\n'
        'calibration = "data/calibration.npz"\n'
        "[tool.cuvil.models.detector]\n"
        'source = "models/detector.onnx"\n'
        'transformed-weights = "first-run"\n'
    )
    files = ("models/classifier.onnx", "models/detector.onnx", "data/calibration.npz")
    cfg = load_project(make_project(tmp_path, text, files), environ={})
    assert cfg.targets == ("x86_64-linux", "aarch64-linux", "universal2-macos")
    classifier, detector = cfg.models
    assert classifier.inputs == {"image": ("batch", 1, 8, 8)}
    assert classifier.quantize == "int8"
    assert classifier.calibration == tmp_path.resolve() / "data/calibration.npz"
    assert detector.name == "detector"
    assert (classifier.transformed_weights, detector.transformed_weights) == ("library", "first-run")


DYNAMIC = '[project]\nname = "digits"\ndynamic = ["version"]\n'


def test_dynamic_version_from_the_package(tmp_path):
    root = make_project(tmp_path, DYNAMIC + MODEL)
    (root / "src" / "digits").mkdir(parents=True)
    init = root / "src" / "digits" / "__init__.py"
    init.write_text('"""Digits."""\n\n__version__: str = "1.02.0-RC1"\n  __version__ = "9"\n')
    cfg = load_project(root, environ={})
    assert (cfg.version, cfg.version_file) == ("1.2.0rc1", init.resolve())
    assert cfg.python_package == root.resolve() / "src" / "digits"


def test_dynamic_version_from_a_file_with_a_regex(tmp_path):
    text = DYNAMIC + (
        "[tool.cuvil.metadata.version]\n"
        'input = "VERSION.txt"\nregex = "release (?P<value>\\\\S+)"\n'
    ) + MODEL
    root = make_project(tmp_path, text)
    (root / "VERSION.txt").write_text("release 2.1\n")
    assert load_project(root, environ={}).version == "2.1"
    (root / "VERSION.txt").write_text("release two\n")
    assert "'two', read from" in config_error(root) and "PEP 440" in config_error(root)
    (root / "VERSION.txt").write_text("nothing\n")
    assert "tool.cuvil.metadata.version.regex" in config_error(root)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (DYNAMIC + MODEL, "no input file to read it from"),
        (DYNAMIC + '[tool.cuvil.metadata.version]\ninput = "V.txt"\nregex = "("\n' + MODEL,
         "metadata.version.regex"),
        (DYNAMIC + '[tool.cuvil.metadata.version]\ninput = "V.txt"\nregex = "v"\n' + MODEL,
         "no group"),
        (DYNAMIC + '[tool.cuvil.metadata.version]\ninput = "V.txt"\nprovider = "git"\n' + MODEL,
         'tool.cuvil.metadata.version.provider: got "git"'),
        (DYNAMIC + '[tool.cuvil.metadata.version]\ninput = "V.txt"\nfile = "x"\n' + MODEL,
         "unknown key tool.cuvil.metadata.version.file"),
        (PROJECT + '[tool.cuvil.metadata.version]\ninput = "V.txt"\n' + MODEL,
         'project.dynamic does not list "version"'),
        (DYNAMIC + '[tool.cuvil.metadata.version]\ninput = "missing.txt"\n' + MODEL,
         "tool.cuvil.metadata.version.input: cannot read"),
    ],
)
def test_dynamic_version_errors(tmp_path, text, expected):
    root = make_project(tmp_path, text)
    (root / "V.txt").write_text("1.0\n")
    assert expected in config_error(root)


def test_python_source(tmp_path):
    root = make_project(tmp_path)
    assert load_project(root, environ={}).python_source is None
    (root / "digits").mkdir()
    assert load_project(root, environ={}).python_package == root.resolve() / "digits"
    (root / "src" / "digits").mkdir(parents=True)
    assert "python-source: both src/digits/ and digits/ exist" in config_error(root)
    (root / "pyproject.toml").write_text(PROJECT + '[tool.cuvil]\npython-source = "src"\n' + MODEL)
    assert load_project(root, environ={}).python_package == root.resolve() / "src" / "digits"
    (root / "pyproject.toml").write_text(PROJECT + '[tool.cuvil]\npython-source = "lib"\n' + MODEL)
    assert "tool.cuvil.python-source" in config_error(root)
    (root / "lib").mkdir()
    assert "holds no folder digits/" in config_error(root)
    (root / "pyproject.toml").write_text(PROJECT + '[tool.cuvil]\npython-source = ".."\n' + MODEL)
    assert "not a folder inside the project root" in config_error(root)


def test_sdist_table(tmp_path):
    text = PROJECT + '[tool.cuvil.sdist]\ninclude = ["scripts/*.py"]\nexclude = ["x"]\n' + MODEL
    cfg = load_project(make_project(tmp_path, text), environ={})
    assert (cfg.sdist.include, cfg.sdist.exclude) == (("scripts/*.py",), ("x",))
    bad = PROJECT + '[tool.cuvil.sdist]\ninclude = "scripts"\n' + MODEL
    assert "tool.cuvil.sdist.include: got" in config_error(make_project(tmp_path, bad))
    bad = PROJECT + '[tool.cuvil.sdist]\nincludes = []\n' + MODEL
    assert "did you mean 'include'" in config_error(make_project(tmp_path, bad))


@pytest.mark.parametrize(
    ("cli", "env", "expected"),
    [
        ({}, {}, 1),  # pyproject
        ({}, {"CUVIL_OPT_LEVEL": "2"}, 2),
        ({"opt-level": "0"}, {"CUVIL_OPT_LEVEL": "2"}, 0),
        ({"opt-level": ["0"]}, {}, 0),
        ({"opt-level": ""}, {"CUVIL_OPT_LEVEL": ""}, 1),  # empty counts as not set
    ],
)
def test_precedence(tmp_path, cli, env, expected):
    text = PROJECT + "[tool.cuvil]\nopt-level = 1\n" + MODEL
    cfg = load_project(make_project(tmp_path, text), cli, env)
    assert cfg.settings.opt_level == expected


def test_default_when_unset_everywhere(tmp_path):
    assert load_project(make_project(tmp_path), {}, {}).settings.opt_level == 3


def test_settings_from_text(tmp_path):
    root = make_project(tmp_path)
    cfg = load_project(
        root,
        {"target": "aarch64-linux", "verbose": "yes", "build-dir": "out"},
        {"CUVIL_CPU": "cortex-a72", "CUVIL_VERBOSE": "0"},
    )
    s = cfg.settings
    assert (s.target, s.cpu, s.verbose) == ("aarch64-linux", "cortex-a72", True)
    assert s.build_dir == tmp_path.resolve() / "out"
    assert load_project(root, {"cpu": "native"}, {}).settings.cpu == "native"


@pytest.mark.parametrize(
    ("name", "package"),
    [("digits-cuvil", "digits"), ("My.Model--Name", "my_model_name"), ("cuvil", "cuvil")],
)
def test_normalize_package_name(name, package):
    assert normalize_package_name(name) == package


@pytest.mark.parametrize("name", ["3d-model", "class", ""])
def test_normalize_package_name_invalid(name):
    with pytest.raises(ConfigError, match=r"Set tool\.cuvil\.package"):
        normalize_package_name(name)


def test_missing_pyproject(tmp_path):
    message = config_error(tmp_path)
    assert "pyproject.toml: not found" in message
    assert "cuvil init" in message


def test_read_pyproject_syntax_error_names_line(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\nversion = \n')
    with pytest.raises(
        ConfigError, match=r"pyproject.toml: invalid TOML: .*line 3.*Fix the syntax"
    ):
        read_pyproject(path)


# Each case: pyproject text, extra files, then the parts the message must contain: the dotted
# key (with the file name checked for all) and a hint on how to fix it.
MISSING_FILE = ("models/classifier.onnx",)
ERRORS = {
    "duplicate table": (
        PROJECT + MODEL + MODEL,
        MISSING_FILE,
        ["invalid TOML", "twice (at line 6", "may appear only once"],
    ),
    "no project table": (MODEL, MISSING_FILE, ["no [project] table", "Add [project]"]),
    "no project name": (
        '[project]\nversion = "1"\n' + MODEL,
        MISSING_FILE,
        ["project.name: missing", 'Add name = "digits-cuvil"'],
    ),
    "no version": (
        '[project]\nname = "digits"\n' + MODEL,
        MISSING_FILE,
        ["project.version", 'dynamic = ["version"]'],
    ),
    "no tool.cuvil": (PROJECT, (), ["no [tool.cuvil] table", "Add [tool.cuvil]"]),
    "no models": (
        PROJECT + '[tool.cuvil]\npackage = "digits"\n',
        (),
        ["tool.cuvil.models: no models", "[tool.cuvil.models.classifier]"],
    ),
    "models not tables": (
        PROJECT + '[tool.cuvil]\nmodels = ["a.onnx"]\n',
        (),
        ["tool.cuvil.models", "expected a table of tables", "Write one table per model"],
    ),
    "unknown model key": (
        PROJECT + '[tool.cuvil.models.classifier]\nsourc = "models/classifier.onnx"\n',
        MISSING_FILE,
        [
            "unknown key tool.cuvil.models.classifier.sourc; did you mean 'source'?",
            "Valid keys there: source, inputs, quantize, calibration",
        ],
    ),
    "unknown tool key": (
        PROJECT + '[tool.cuvil]\ntargts = ["x86_64-linux"]\n' + MODEL,
        MISSING_FILE,
        ["unknown key tool.cuvil.targts; did you mean 'targets'?", "Valid keys there"],
    ),
    "typo of models table": (
        PROJECT + '[tool.cuvil.model.classifier]\nsource = "m.onnx"\n',
        (),
        ["unknown key tool.cuvil.model; did you mean 'models'?"],
    ),
    "targets not a list": (
        PROJECT + '[tool.cuvil]\ntargets = "x86_64-linux"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.targets", "expected an array of strings", "Write e.g. targets = ["],
    ),
    "targets with an int": (
        PROJECT + "[tool.cuvil]\ntargets = [1]\n" + MODEL,
        MISSING_FILE,
        ["tool.cuvil.targets", "got [1] (an array)", "Write e.g. targets ="],
    ),
    "target not a string": (
        PROJECT + "[tool.cuvil]\ntarget = 5\n" + MODEL,
        MISSING_FILE,
        ["tool.cuvil.target", "got 5 (an integer), expected a string", 'target = "aarch64-linux"'],
    ),
    "bool for int": (
        PROJECT + "[tool.cuvil]\nopt-level = true\n" + MODEL,
        MISSING_FILE,
        ["tool.cuvil.opt-level", "got true (a boolean)", "one of 0, 1, 2, 3", "opt-level = 2"],
    ),
    "opt-level out of range": (
        PROJECT + "[tool.cuvil]\nopt-level = 4\n" + MODEL,
        MISSING_FILE,
        ["tool.cuvil.opt-level", "got 4 (an integer), expected one of 0, 1, 2, 3"],
    ),
    "verbose not bool": (
        PROJECT + '[tool.cuvil]\nverbose = "yes"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.verbose", "expected a boolean", "verbose = true"],
    ),
    "inputs not a table": (
        PROJECT + MODEL + "inputs = [1, 8]\n",
        MISSING_FILE,
        ["tool.cuvil.models.classifier.inputs", "expected a table", "Write e.g. inputs = {"],
    ),
    "inputs dims not a list": (
        PROJECT + MODEL + "inputs = { image = 8 }\n",
        MISSING_FILE,
        ["tool.cuvil.models.classifier.inputs.image", "expected an array of dims", "inputs = {"],
    ),
    "zero dim": (
        PROJECT + MODEL + "inputs = { image = [1, 0] }\n",
        MISSING_FILE,
        ["tool.cuvil.models.classifier.inputs.image[1]", "got 0", "integer >= 1", "inputs = {"],
    ),
    "negative dim": (
        PROJECT + MODEL + "inputs = { image = [-1] }\n",
        MISSING_FILE,
        ["tool.cuvil.models.classifier.inputs.image[0]", "got -1", "inputs = {"],
    ),
    "bool dim": (
        PROJECT + MODEL + 'inputs = { "x:0" = [true] }\n',
        MISSING_FILE,
        ['tool.cuvil.models.classifier.inputs."x:0"[0]', "got true (a boolean)", "inputs = {"],
    ),
    "float dim": (
        PROJECT + MODEL + "inputs = { image = [1.5] }\n",
        MISSING_FILE,
        ["inputs.image[0]", "got 1.5 (a float)", "inputs = {"],
    ),
    "non-identifier symbolic dim": (
        PROJECT + MODEL + 'inputs = { image = ["batch size"] }\n',
        MISSING_FILE,
        ["inputs.image[0]", "identifier string", "inputs = {"],
    ),
    "missing source key": (
        PROJECT + '[tool.cuvil.models.classifier]\nquantize = "none"\n',
        (),
        ["tool.cuvil.models.classifier.source: missing", 'Add e.g. source = "models/'],
    ),
    "missing model file": (
        PROJECT + MODEL,
        (),
        [
            "tool.cuvil.models.classifier.source: cannot read",
            "models/classifier.onnx",
            "relative to the project root",
            "Fix the path or add the file",
        ],
    ),
    "package named like a standard-library module": (
        PROJECT + '[tool.cuvil]\npackage = "json"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.package", '"json" is the import name of a module of Python\'s standard library',
         "could never be imported", 'package = "json_model"'],
    ),
    "project name giving a standard-library module": (
        PROJECT.replace("digits-cuvil", "email-cuvil") + MODEL,
        MISSING_FILE,
        ["tool.cuvil.package", '"email" (made from project.name "email-cuvil")', "standard library"],
    ),
    "package named numpy": (
        PROJECT + '[tool.cuvil]\npackage = "numpy"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.package", "numpy, which every generated package imports"],
    ),
    "package name too long": (
        PROJECT + f'[tool.cuvil]\npackage = "{"p" * 300}"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.package", "has 300 characters, more than the 64", "_model"],
    ),
    "model name too long": (
        PROJECT + f'[tool.cuvil.models.{"m" * 65}]\nsource = "models/classifier.onnx"\n',
        MISSING_FILE,
        [f"tool.cuvil.models.{'m' * 65}", "has 65 characters, more than the 64", "Rename the table"],
    ),
    "model source is a folder": (
        PROJECT + '[tool.cuvil.models.classifier]\nsource = "models"\n',
        MISSING_FILE,
        ["tool.cuvil.models.classifier.source", '"models" is a directory, not a file',
         "Give the path of the file itself"],
    ),
    "absolute source": (
        PROJECT + '[tool.cuvil.models.classifier]\nsource = "/srv/models/classifier.onnx"\n',
        (),
        ["tool.cuvil.models.classifier.source", "absolute path", "relative to the project root"],
    ),
    "source outside the project": (
        PROJECT + '[tool.cuvil.models.classifier]\nsource = "../outside.onnx"\n',
        (),
        ["tool.cuvil.models.classifier.source", "outside the project root", "sdist"],
    ),
    "package with a dash": (
        PROJECT + '[tool.cuvil]\npackage = "my-digits"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.package", "not a valid import name", 'package = "digits"'],
    ),
    "package is a keyword": (
        PROJECT + '[tool.cuvil]\npackage = "import"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.package", "not a Python keyword", 'package = "digits"'],
    ),
    "default package invalid": (
        '[project]\nname = "3d-cuvil"\nversion = "1"\n' + MODEL,
        MISSING_FILE,
        ['project.name "3d-cuvil" gives no valid import name', "Set tool.cuvil.package"],
    ),
    "model name with a dash": (
        PROJECT + '[tool.cuvil.models.my-model]\nsource = "models/classifier.onnx"\n',
        MISSING_FILE,
        ["tool.cuvil.models.my-model", "model name", "Rename the table"],
    ),
    "model name is a keyword": (
        PROJECT + '[tool.cuvil.models.class]\nsource = "models/classifier.onnx"\n',
        MISSING_FILE,
        ["tool.cuvil.models.class", "not a Python keyword", "Rename the table"],
    ),
    "model names differ in case": (
        PROJECT + MODEL + MODEL.replace(".classifier]", ".Classifier]"),
        MISSING_FILE,
        ["tool.cuvil.models.Classifier", "models.classifier only in case", "Rename one"],
    ),
    "model not a table": (
        PROJECT + '[tool.cuvil.models]\nclassifier = "models/classifier.onnx"\n',
        MISSING_FILE,
        ["tool.cuvil.models.classifier", "expected a table", "Write [tool.cuvil.models."],
    ),
    "unknown quantize": (
        PROJECT + MODEL + 'quantize = "fp16"\n',
        MISSING_FILE,
        ["tool.cuvil.models.classifier.quantize", 'one of "none", "int8"', 'quantize = "int8"'],
    ),
    "unknown transformed-weights": (
        PROJECT + MODEL + 'transformed-weights = "derived"\n',
        MISSING_FILE,
        ["tool.cuvil.models.classifier.transformed-weights", 'one of "library", "first-run"',
         'transformed-weights = "first-run"'],
    ),
    "int8 without calibration": (
        PROJECT + MODEL + 'quantize = "int8"\n',
        MISSING_FILE,
        ["tool.cuvil.models.classifier.calibration: missing", 'Add calibration = "'],
    ),
    "missing calibration file": (
        PROJECT + MODEL + 'quantize = "int8"\ncalibration = "data/calibration.npz"\n',
        MISSING_FILE,
        ["tool.cuvil.models.classifier.calibration: cannot read", "calibration.npz", "Fix"],
    ),
    "cpu native for a cross target": (
        PROJECT + '[tool.cuvil]\ntarget = "aarch64-linux"\ncpu = "native"\n' + MODEL,
        MISSING_FILE,
        ["tool.cuvil.cpu", "tool.cuvil.target", "Unset target"],
    ),
}


@pytest.mark.parametrize(("text", "files", "parts"), ERRORS.values(), ids=ERRORS.keys())
def test_errors(tmp_path, text, files, parts):
    (tmp_path / "outside.onnx").write_bytes(b"")
    message = config_error(make_project(tmp_path / "proj", text, files))
    assert "pyproject.toml" in message
    for part in parts:
        assert part in message


@pytest.mark.parametrize(
    ("cli", "env", "parts"),
    [
        ({"opt_level": "2"}, {}, ["-C", "unknown key opt_level; did you mean 'opt-level'?"]),
        ({"opt-level": "fast"}, {}, ["-C opt-level=fast", "not an integer", "-C opt-level=2"]),
        ({"opt-level": "9"}, {}, ["-C opt-level=9", "one of 0, 1, 2, 3", "-C opt-level=2"]),
        ({"opt-level": ["1", "2"]}, {}, ["-C opt-level", "given 2 times", "Pass it once"]),
        ({}, {"CUVIL_VERBOSE": "maybe"}, ["CUVIL_VERBOSE=maybe", "yes/no", "CUVIL_VERBOSE=true"]),
        (
            {"target": "aarch64-linux"},
            {"CUVIL_CPU": "native"},
            ["CUVIL_CPU=native", "-C target=aarch64-linux", "Unset target"],
        ),
    ],
)
def test_setting_errors(tmp_path, cli, env, parts):
    message = config_error(make_project(tmp_path), cli, env)
    for part in parts:
        assert part in message


def test_docs_are_current():
    render = runpy.run_path(str(REPO / "scripts" / "gen_config_docs.py"))["render"]
    current = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert current == render(), "docs/config.md is stale: run scripts/gen_config_docs.py"


def test_absolute_source_inside_the_project_is_refused(tmp_path):
    # it would be accepted here but point outside the sdist's copy of the project
    root = make_project(tmp_path)
    inside = (root / "models/classifier.onnx").resolve()
    text = PROJECT + f'[tool.cuvil.models.classifier]\nsource = "{inside}"\n'
    (root / "pyproject.toml").write_text(text, encoding="utf-8")
    message = config_error(root)
    assert "absolute path" in message and "relative to the project root" in message


def test_a_model_source_that_is_a_fifo_is_refused_without_opening_it(tmp_path, fifo):
    root = make_project(tmp_path, files=())
    fifo(root / "models" / "classifier.onnx")
    message = config_error(root)
    assert "tool.cuvil.models.classifier.source" in message
    assert '"models/classifier.onnx" is a FIFO (named pipe), not a file' in message
