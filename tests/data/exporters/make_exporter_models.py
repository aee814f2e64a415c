"""Make the small models of tests/frontend/test_exporter_conventions.py with the real exporters,
each in its own style of writing unknown dims. Run with the framework installed (each needs a
large package that the tests themselves do not), from this folder:

    python make_exporter_models.py paddle   # paddlepaddle + paddle2onnx: dims -1 and "?"
    python make_exporter_models.py tf       # tensorflow-cpu + tf2onnx: NHWC, "unk__N" dims
    python make_exporter_models.py torch    # torch: named dynamic axes
    python make_exporter_models.py legacy   # paddle_classifier.onnx as paddle2onnx < 2 wrote it

Weights are random (seeded); what matters is the exporters' graphs and their declared shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def paddle_model() -> None:
    import paddle
    from paddle import nn

    paddle.seed(0)

    class Classifier(nn.Layer):  # an OCR direction classifier in miniature
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2D(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2D(8)
            self.pool = nn.AdaptiveAvgPool2D(1)
            self.fc = nn.Linear(8, 2)

        def forward(self, x: paddle.Tensor) -> paddle.Tensor:
            y = self.pool(nn.functional.relu(self.bn(self.conv(x))))
            return nn.functional.softmax(self.fc(paddle.flatten(y, 1)), axis=-1)

    net = Classifier()
    net.eval()
    spec = [paddle.static.InputSpec([None, 3, None, None], "float32", "x")]
    paddle.onnx.export(net, str(HERE / "paddle_classifier"), input_spec=spec, opset_version=13)


def tf_model() -> None:
    import tensorflow as tf
    import tf2onnx

    tf.random.set_seed(0)
    inputs = tf.keras.Input(shape=(None, None, 3), name="image")
    x = tf.keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = tf.keras.layers.MaxPooling2D()(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(4, activation="softmax")(x)
    model = tf.keras.Model(inputs, outputs)
    spec = (tf.TensorSpec((None, None, None, 3), tf.float32, name="image"),)
    tf2onnx.convert.from_keras(model, input_signature=spec, opset=13,
                               output_path=str(HERE / "tf_classifier.onnx"))


def torch_model() -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
                        nn.Flatten(), nn.Linear(8, 3)).eval()
    torch.onnx.export(net, (torch.randn(2, 4, 16),), str(HERE / "torch_sequence.onnx"),
                      input_names=["signal"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"signal": {0: "batch", 2: "time"}, "logits": {0: "batch"}},
                      dynamo=False)


def legacy_paddle_model() -> None:
    """paddle2onnx 2 names unknown dims "DynamicDimension.N"; earlier versions (and models
    shipped in public OCR packages) wrote `dim_value: -1` for the batch and `dim_param: "?"`
    for every other unknown dim, several different dims sharing the name. Only the declared
    shapes change: the graph is paddle_classifier.onnx's."""
    import onnx

    model = onnx.load(str(HERE / "paddle_classifier.onnx"))
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                if d.dim_param == "DynamicDimension.0":
                    d.dim_value = -1
                else:
                    d.dim_param = "?"
    onnx.checker.check_model(model)
    onnx.save(model, str(HERE / "paddle_legacy_classifier.onnx"))


if __name__ == "__main__":
    {"paddle": paddle_model, "tf": tf_model, "torch": torch_model,
     "legacy": legacy_paddle_model}[sys.argv[1]]()
