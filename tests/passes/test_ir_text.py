"""The IR's text form (passes/ir_text.py) and `cuvil inspect --ir [--after PASS]`: a Conv ->
BatchNormalization -> Relu block written out before and after the passes that change it, as
expected by hand; and the compiled block against onnxruntime, so that the graphs shown are
the ones that compute the right answer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracle import assert_matches_ort

from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import STAGES, run_passes
from cuvil.compiler.passes.ir_text import graph_text
from cuvil.compiler.passes.plan_memory import plan_memory
from cuvil.errors import ConfigError

CHANNELS = 16  # more than ir_text.SHOWN_ELEMENTS: the per-channel constants show as sizes


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    c = CHANNELS
    inits = [numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "scale"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "shift"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "mean"),
             numpy_helper.from_array((rng.random(c) + 0.5).astype(np.float32), "var"),
             numpy_helper.from_array(np.array([0, -1], np.int64), "flat")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["conv", "scale", "shift", "mean", "var"],
                              ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["act"], name="relu"),
             helper.make_node("Reshape", ["act", "flat"], ["y"], name="flatten")]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c * 64])], inits)
    path = tmp_path_factory.mktemp("ir") / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def text_after(path: Path, stage: str | None, plan: bool = False) -> str:
    graph = run_passes(import_model(str(path), None, "block"), until=stage)
    return graph_text(graph, plan_memory(graph) if plan else None)


FRONTEND = """\
graph block
  input  %x: float32[batch, 3, 8, 8]
  const  %w: float32[16, 3, 3, 3] (1728 bytes)
  %conv: float32[batch, 16, 8, 8] = Conv(%x, %w) {pads=[1, 1, 1, 1]}  # conv
  const  %scale: float32[16] (64 bytes)
  const  %shift: float32[16] (64 bytes)
  const  %mean: float32[16] (64 bytes)
  const  %var: float32[16] (64 bytes)
  %bn: float32[batch, 16, 8, 8] = BatchNormalization(%conv, %scale, %shift, %mean, %var)  # bn
  %act: float32[batch, 16, 8, 8] = Relu(%bn)  # relu
  const  %flat: int64[2] = [0, -1]
  %y: float32[batch, 1024] = Reshape(%act, %flat)  # flatten
  output %y"""

# fold_batchnorm: the normalization becomes the conv's weights and a bias; the conv writes
# the BatchNormalization's output
FOLDED = """\
graph block
  input  %x: float32[batch, 3, 8, 8]
  const  %w_bn: float32[16, 3, 3, 3] (1728 bytes)
  const  %w_bn_bias: float32[16] (64 bytes)
  %bn: float32[batch, 16, 8, 8] = Conv(%x, %w_bn, %w_bn_bias) {pads=[1, 1, 1, 1]}  # conv
  %act: float32[batch, 16, 8, 8] = Relu(%bn)  # relu
  const  %flat: int64[2] = [0, -1]
  %y: float32[batch, 1024] = Reshape(%act, %flat)  # flatten
  output %y"""

# fuse_epilogue (after pack_gemm_weights, which packs the kernel in panels): the Relu runs in
# the conv's epilogue
FUSED = """\
graph block
  input  %x: float32[batch, 3, 8, 8]
  const  %w_bn_panels: float32[16, 3, 3, 3] (1728 bytes)
  const  %w_bn_bias: float32[16] (64 bytes)
  %act: float32[batch, 16, 8, 8] = Conv+Relu(%x, %w_bn_panels, %w_bn_bias) \
{cuvil.activation_params=[], cuvil.fused_activation="Relu", cuvil.packed_weights=1, \
pads=[1, 1, 1, 1]}  # conv
  const  %flat: int64[2] = [0, -1]
  %y: float32[batch, 1024] = Reshape(%act, %flat)  # flatten
  output %y"""


@pytest.mark.parametrize("stage, expected", [("frontend", FRONTEND), ("bodies", FRONTEND),
                                             ("fold_batchnorm", FOLDED),
                                             ("pack_gemm_weights", FOLDED.replace("w_bn:", "w_bn_panels:")
                                              .replace("%w_bn,", "%w_bn_panels,")
                                              .replace("{pads", "{cuvil.packed_weights=1, pads")),
                                             ("fuse_epilogue", FUSED), (None, FUSED)])
def test_the_graph_after_each_stage_reads_as_expected(block: Path, stage: str | None,
                                                      expected: str) -> None:
    assert text_after(block, stage) == expected


def test_with_the_memory_plan_each_value_says_where_it_lives(block: Path) -> None:
    lines = text_after(block, None, plan=True).splitlines()
    assert lines[1] == "  input  %x: float32[batch, 3, 8, 8] @input 0"
    assert lines[2] == "  const  %w_bn_panels: float32[16, 3, 3, 3] @weights+0 (1728 bytes)"
    assert lines[3] == "  const  %w_bn_bias: float32[16] @weights+1728 (64 bytes)"
    # the conv's result lives in the workspace (Reshape's output aliases the model's output)
    assert lines[4].startswith("  %act: float32[batch, 16, 8, 8] @workspace+0 = Conv+Relu(")


def test_the_block_as_compiled_matches_onnxruntime(block: Path) -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert_matches_ort(onnx.load(str(block)), {"x": x})


def test_an_unknown_stage_is_refused_with_the_list() -> None:
    graph = import_model(onnx.helper.make_model(onnx.helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)]), None, "g")
    with pytest.raises(ConfigError, match="no pass named 'fold_batchnrom'; the stages are "
                                          "frontend, bodies, "):
        run_passes(graph, until="fold_batchnrom")
    assert "fuse_epilogue" in STAGES and STAGES.index("fold_batchnorm") < STAGES.index("fuse_epilogue")


def cuvil(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cuvil", *args], capture_output=True, text=True,
                          timeout=300)


def test_cuvil_inspect_ir_prints_the_graph_after_a_pass(block: Path) -> None:
    done = cuvil("inspect", str(block), "--ir", "--after", "fold_batchnorm")
    assert done.returncode == 0, done.stderr
    assert done.stdout == FOLDED + "\n"
    done = cuvil("inspect", str(block), "--ir", "--input", "x=4,3,8,8")
    assert done.returncode == 0, done.stderr
    assert "  input  %x: float32[4, 3, 8, 8] @input 0" in done.stdout.splitlines()
    done = cuvil("inspect", str(block), "--after", "nope")
    assert done.returncode != 0 and "no pass named 'nope'" in done.stderr
