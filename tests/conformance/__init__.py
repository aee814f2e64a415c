"""ONNX backend conformance: onnx's node test cases and shipped model tests run through
`cuvil.onnx_backend`. `scope.py` says what is out of scope and why, `runner.py` runs cases,
`test_conformance.py` holds the CI gate and `scripts/gen_conformance.py` writes the report."""
